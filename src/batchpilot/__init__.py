"""batchpilot: pick and keep the best batch size for a PyTorch job."""
