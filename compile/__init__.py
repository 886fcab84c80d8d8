"""Layer 4, compilation: `ladder compile` artifacts (torch.compile, ONNX, TensorRT) and their loaders."""
