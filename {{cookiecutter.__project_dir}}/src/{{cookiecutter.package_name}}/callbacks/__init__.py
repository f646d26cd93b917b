"""The project's callbacks: actions at the loop's events, picked with
``callbacks=NAME`` or ``callbacks=[A,B]`` (configs/callbacks/)."""
