"""A real server under faults, fuzzing, hostile requests and long load."""
