"""The iluvatar platform: calc-stream all-reduce, device cleanup, and the ERNIE-VL tp>1 graph veto."""
