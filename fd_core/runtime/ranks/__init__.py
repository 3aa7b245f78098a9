"""Ranks: spawning them (or joining a launcher's), their rendezvous, one rank's worker, and the pool that ticks them."""
