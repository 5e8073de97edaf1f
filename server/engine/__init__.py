"""The engine and what feeds it: one thread per model stepping every session of that model in one
batch (engine.py), the served models (loading.py), prompts as token ids (prompts.py), and
admission (admission.py)."""
