#!/bin/bash
echo "hello from turnrl" > /app/greeting.txt
