"""fd's own KV transports (contract 1.9): `shm`, between instances on one host, and `local`, between instances in one
process (the Python API's, and the tests' fake transport)."""
