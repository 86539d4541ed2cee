"""The main job: the driver that launches it and the worker each rank runs."""
