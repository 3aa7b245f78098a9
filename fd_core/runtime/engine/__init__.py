"""The engine: the model's lifecycle on a rank (runner), the one generation loop (loop), sampling, and the
scheduler that feeds requests from any thread into it."""
