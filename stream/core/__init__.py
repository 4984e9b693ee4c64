"""The pipeline's core: the values that travel between stages and the two seams (frames), batching across
streams (batcher), and the run itself: how one is built, each stream's work, the runner's lifecycle.
"""
