"""Engines: ONNX Runtime on the CPU (cpu) and on CUDA (cuda), the choice between them (device), what a model
file declares (model), RetinaNet's post-processing outside the graph (postprocess, postprocess_cuda, kernels).
"""
