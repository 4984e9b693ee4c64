"""Tools beside the daemon: the ONNX export of torchvision's RetinaNet (export), the sample video (sample), the
configuration reference generated from the config's key descriptions (config_docs).
"""
