"""uvicorn's Server for the app (app.py) that shuts down gracefully: on SIGTERM or SIGINT the app
first drains (503 for new requests, running ones finish within its grace period, then end), and
the server waits a little longer than that grace for its connections to close."""

from __future__ import annotations

import uvicorn

CLOSING_MARGIN_S = 5.0    # past the app's grace: the streams it ended get to send their last events


class DrainingServer(uvicorn.Server):
    def __init__(self, app, config: uvicorn.Config):
        config.timeout_graceful_shutdown = app.state.operations.shutdown_grace + CLOSING_MARGIN_S
        super().__init__(config)
        self.drain = app.state.drain

    def handle_exit(self, sig, frame) -> None:
        self.drain()
        super().handle_exit(sig, frame)
