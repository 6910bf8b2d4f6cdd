"""Other projects' implementations run by our trainer as peers, measured side by side with ours."""
