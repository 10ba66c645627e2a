"""From traces to a decision: a hardware model, a replay of a traced layout as the whole job
(time, bubbles, exposed communication, MFU, memory), and measurements of this machine's links.

Imports neither torch nor megatron (``calibrate`` does, when it runs).
"""
