"""Benchmarks of linstream, run from the repository root as `python -m benchmarks.<group>.<name>`;
run_all.sh lists them all with the command behind each file in results/."""
