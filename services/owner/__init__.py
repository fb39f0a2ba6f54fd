"""owner: runs session programs for one deployment."""
