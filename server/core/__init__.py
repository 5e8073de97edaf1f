"""The ground floor: errors, settings, metrics, API keys, rate limits and the C heap."""
