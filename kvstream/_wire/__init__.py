"""Wire rules shared by both ends of a transport (framing, sequence, replay), written once."""
