"""Models genpipe builds itself (the built-in tiny model), shared by both workers."""
