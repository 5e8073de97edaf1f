"""The engine and what feeds it: one thread per model stepping every session of that model in one
batch (engine.py; its step planned in plan.py, run in execute.py, sampled in emit.py), the served
models (loading.py), prompts as token ids (prompts.py), and admission (admission.py)."""
