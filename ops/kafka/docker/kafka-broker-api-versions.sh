#!/bin/bash
# The apache/kafka image's tool of the same name (docker-compose.yml's healthcheck).
exec java -Xmx128m -XX:TieredStopAtLevel=1 -Dorg.apache.logging.log4j.level=ERROR \
  -cp '/opt/kafka/libs/*' org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
