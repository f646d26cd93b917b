"""Puts the engine's config groups on every Hydra app's search path (after the app's
own config folder, whose files of the same name win)."""
