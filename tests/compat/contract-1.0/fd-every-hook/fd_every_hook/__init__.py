"""every_hook: every hook of fd's contract 1.0, on the host's CPU, through the documented API only."""
