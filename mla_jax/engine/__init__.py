"""Serving: requests, the scheduler, the model runner, the engine that drives them, and the
persistent compilation cache."""
