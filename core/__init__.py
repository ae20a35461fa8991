"""What every process shares: settings, clients, logs, errors, the one clock and horizon, the
repository and namespace registry, the guards, and the one gate every delete passes."""
