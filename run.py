"""Entry point: ``python run.py +exp=NAME [overrides]`` (Hydra). All logic is in zero_repro.lab.cli."""
from zero_repro.lab.cli import main

if __name__ == "__main__":
    main()
