"""P2P sharing of CPU tiers between instances, coordinated by kvferry-controller."""
