"""linstream server: FastAPI app, sessions, and the continuous-batching engine."""
