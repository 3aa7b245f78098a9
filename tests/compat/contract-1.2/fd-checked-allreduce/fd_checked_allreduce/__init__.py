"""fd-backends platform `cpu_checked`: the cpu platform with every all-reduce checked across ranks first."""

__version__ = "0.2.0"
