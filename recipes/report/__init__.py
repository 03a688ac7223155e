"""What a run shows while it trains: sample generations, the loss plot and its PNG writer."""
