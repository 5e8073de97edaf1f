"""The runtime the routes act on (runtime.py), its background tasks, and a generation's stream handle."""
