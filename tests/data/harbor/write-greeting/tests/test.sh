#!/bin/sh
# The agent must have written /app/greeting.txt through its own tool.
if [ "$(cat /app/greeting.txt 2>/dev/null)" = "hello from turnrl" ]; then
  echo "greeting.txt is right"
  echo 1 > /logs/verifier/reward.txt
else
  echo "greeting.txt is missing or wrong: $(cat /app/greeting.txt 2>&1 | head -c 200)"
  echo 0 > /logs/verifier/reward.txt
fi
