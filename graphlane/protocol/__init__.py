"""Wire protocol of graphlane (filled in by the daemon work)."""
