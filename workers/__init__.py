"""genpipe runtime: Kafka plumbing, the generate and derender workers, client and CLI."""
