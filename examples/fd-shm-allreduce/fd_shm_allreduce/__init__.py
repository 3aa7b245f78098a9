"""fd-backends platform `cpu_shm`: the cpu platform with a same-host shared-memory all-reduce."""

__version__ = "0.1.0"
