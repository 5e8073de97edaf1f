"""linstream beside llama.cpp (llama-cpp-python) and transformers on the same networks: shipped.py
and mamba130m.py run; the other modules are their parts."""
