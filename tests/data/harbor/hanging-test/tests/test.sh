#!/bin/sh
echo "checking forever"
sleep 1000 &
sleep 1000
