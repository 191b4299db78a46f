#!/bin/sh
if [ "$(cat /app/farewell.txt 2>/dev/null)" = "goodbye from turnrl" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "farewell.txt is missing or wrong"
  echo 0 > /logs/verifier/reward.txt
fi
