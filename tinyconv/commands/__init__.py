"""The commands a user types: ``tinyconv train`` (the main job), and the options every command shares."""
