"""Serve DIR on 127.0.0.1:PORT until killed; prints the port once it listens.

    python3 ops/docker/serve_dir.py DIR PORT

build-images.sh lets pip inside `docker build --network host` read the host's
wheelhouse through it (`pip install --no-index --find-links http://127.0.0.1:PORT/`).
The port is part of that build argument, so it is fixed: a new one would invalidate
Docker's layer cache of the dependency install.
"""

import functools
import http.server
import sys


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # pip fetches dozens of files: no line for each
        pass


handler = functools.partial(QuietHandler, directory=sys.argv[1])
try:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), handler)
except OSError as exc:
    sys.exit(f"serve_dir: cannot listen on 127.0.0.1:{sys.argv[2]} ({exc}); "
             "choose another port with GENPIPE_WHEELHOUSE_PORT")
with server:
    print(server.server_address[1], flush=True)
    server.serve_forever()
