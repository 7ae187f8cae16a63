"""Models that ship with diloco (any ``torch.nn.Module`` can be trained; see recipes)."""
