"""The scripts against TRL's trainers on the same model, task, batch and steps, on one machine."""
