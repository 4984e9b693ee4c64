"""Tools beside the daemon: the ONNX export of torchvision's RetinaNet (export), the sample video (sample).
"""
