"""N engines on Ray behind one `generate`: actors, routing, restarts, weight updates, Ray start and room."""
