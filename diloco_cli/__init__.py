"""diloco: train one PyTorch model across regions joined only by object storage.

An implementation of Decoupled DiLoCo (Google DeepMind, "Decoupled DiLoCo for Resilient
Distributed Pre-training", arXiv 2604.21428).
"""

__version__ = "0.1.0"
