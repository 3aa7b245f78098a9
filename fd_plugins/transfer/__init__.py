"""fd's own KV transports (contract 1.9): `shm`, between instances on one host; `tcp`, between instances on any hosts
(ZeroMQ); and `local`, between instances in one process (the Python API's, and the tests' fake transport)."""
