/* What the C tests (harness.c, duty.c) check with: CHECK counts a failure and says where, and the test goes on, so
 * that one run names every check that failed in its scenario. Each test program includes this once. */
#ifndef GPUPPETTI_TESTS_CHECK_H
#define GPUPPETTI_TESTS_CHECK_H

#include <stdio.h>

static const char *scenario_name = "";
static int failures;

#define CHECK(condition, ...)                                                                                        \
    do {                                                                                                             \
        if (!(condition)) {                                                                                          \
            fprintf(stderr, "%s: %s:%d: %s: ", scenario_name, __FILE__, __LINE__, #condition);                       \
            fprintf(stderr, __VA_ARGS__);                                                                            \
            fputc('\n', stderr);                                                                                     \
            failures++;                                                                                              \
        }                                                                                                            \
    } while (0)

#endif
