"""Layer 5, `ladder doctor`: this machine's limits, the model's cost per step, a roofline of the steps the
engine runs, and the five-layer verdict on where the time goes."""
