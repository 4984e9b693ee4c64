"""Sources: what the user named turned into streams (naming), and each stream turned into batches of model
input: PyAV on the CPU (pyav, host), DALI on NVDEC for files (dali), live feeds (live, nvdec), replay (looping).
"""
