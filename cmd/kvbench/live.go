package main

import (
	"context"
	"errors"
	"io"
)

func runLive(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return errors.New("live: not built yet")
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return errors.New("demo: not built yet")
}
