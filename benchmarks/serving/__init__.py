"""Figures over HTTP against a real `linstream serve`: the request path, CPU per request and per
thread, the client's own cost, many sessions, several choices, chat with the prefix cache."""
