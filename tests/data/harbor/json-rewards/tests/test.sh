#!/bin/sh
# reward.json: the one named `reward` trains; the others are kept in info["tests"]["rewards"].
if [ -f /app/greeting.txt ]; then written=1; else written=0; fi
printf '{"reward": %s, "style": 0.5}\n' "$written" > /logs/verifier/reward.json
