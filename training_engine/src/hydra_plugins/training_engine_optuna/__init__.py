"""The project's Optuna sweeper for Hydra (``-m hparams_search=optuna``); see sweeper.py."""
