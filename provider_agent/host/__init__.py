"""Plugin hosts: one long-lived subprocess per loaded model (DESIGN §3, agent ↔ plugin host)."""
