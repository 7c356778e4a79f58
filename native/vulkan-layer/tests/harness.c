/* The layer's behaviour, in C, through the real Vulkan loader, built with AddressSanitizer and
 * UndefinedBehaviorSanitizer like the layer it loads (make check). Two drivers: a real one, Mesa's lavapipe (a CPU
 * device, one heap, no VK_EXT_memory_budget of its own), and a fake one (fake_icd.c) whose GPUs, heaps, budgets and
 * PCI bus addresses each scenario sets, for what lavapipe cannot provoke: a discrete GPU's device-local and host
 * heaps, a driver with its own memory budget, several GPUs. The fake driver counts what reaches it, so a scenario
 * can tell what the layer refused from what the driver refused.
 *
 *   harness                 run every scenario, each in a process of its own with its own environment
 *   harness SCENARIO        run one (the environment already set)
 *
 * make check installs the layer as an implicit layer (XDG_DATA_HOME) and says where the drivers are:
 * HARNESS_LAVAPIPE (lavapipe's manifest; empty: its scenarios are skipped), HARNESS_FAKE_ICD (the fake driver's
 * manifest) and HARNESS_FAKE_ICD_LIBRARY (its library), and how to serve a ledger: the daemons' own code
 * (python -m gpuppetti.layer.ledgers serve), run by HARNESS_LEDGER_PYTHON with HARNESS_LEDGER_PATH as its PYTHONPATH,
 * one ledger per scenario that has one. A scenario reads the ledger's figures as any process of the allocation
 * can: through the shared page of a connection of its own that holds nothing. Exit status: 0 when every scenario
 * passed, 1 otherwise; a scenario that crashes or that a sanitizer stops is a failure.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vulkan/vulkan.h>

#include "../ledger.h"
#include "fake_icd.h"
#include "check.h"

#define MIB (1024ull * 1024ull)
#define GIB (1024ull * MIB)
#define SLICE_MIB 256

/* -- Vulkan helpers -------------------------------------------------------------------------------------------- */

static VkInstance make_instance(void)
{
    VkApplicationInfo application = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .apiVersion = VK_API_VERSION_1_1};
    VkInstanceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &application};
    VkInstance instance = VK_NULL_HANDLE;
    VkResult result = vkCreateInstance(&info, NULL, &instance);
    CHECK(result == VK_SUCCESS, "vkCreateInstance: %d", result);
    return result == VK_SUCCESS ? instance : VK_NULL_HANDLE;
}

static VkPhysicalDevice first_gpu(VkInstance instance)
{
    uint32_t count = 1;
    VkPhysicalDevice physical = VK_NULL_HANDLE;
    VkResult result = vkEnumeratePhysicalDevices(instance, &count, &physical);
    CHECK(result == VK_SUCCESS || result == VK_INCOMPLETE, "vkEnumeratePhysicalDevices: %d", result);
    CHECK(count == 1 && physical != VK_NULL_HANDLE, "no GPU enumerated");
    return physical;
}

static bool has_device_extension(VkPhysicalDevice physical, const char *name, int *times)
{
    uint32_t count = 0;
    vkEnumerateDeviceExtensionProperties(physical, NULL, &count, NULL);
    VkExtensionProperties *properties = calloc(count ? count : 1, sizeof *properties);
    vkEnumerateDeviceExtensionProperties(physical, NULL, &count, properties);
    int found = 0;
    for (uint32_t i = 0; i < count; i++) {
        found += strcmp(properties[i].extensionName, name) == 0;
    }
    free(properties);
    if (times != NULL) {
        *times = found;
    }
    return found > 0;
}

static VkDevice make_device(VkPhysicalDevice physical, const char *const *extensions, uint32_t extension_count)
{
    float priority = 1.0f;
    VkDeviceQueueCreateInfo queue = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, .queueFamilyIndex = 0,
                                     .queueCount = 1, .pQueuePriorities = &priority};
    VkDeviceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, .queueCreateInfoCount = 1,
                               .pQueueCreateInfos = &queue, .enabledExtensionCount = extension_count,
                               .ppEnabledExtensionNames = extensions};
    VkDevice device = VK_NULL_HANDLE;
    VkResult result = vkCreateDevice(physical, &info, NULL, &device);
    CHECK(result == VK_SUCCESS, "vkCreateDevice: %d", result);
    return result == VK_SUCCESS ? device : VK_NULL_HANDLE;
}

static VkResult allocate_in(VkDevice device, uint32_t type, VkDeviceSize size, const void *next,
                            VkDeviceMemory *out)
{
    VkMemoryAllocateInfo info = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, .pNext = next,
                                 .allocationSize = size, .memoryTypeIndex = type};
    return vkAllocateMemory(device, &info, NULL, out);
}

static VkResult allocate(VkDevice device, VkDeviceSize size, const void *next, VkDeviceMemory *out)
{
    return allocate_in(device, 0, size, next, out);
}

static void budget_of(VkPhysicalDevice physical, VkDeviceSize *heap_size, VkDeviceSize *budget, VkDeviceSize *usage)
{
    VkPhysicalDeviceMemoryBudgetPropertiesEXT budgets = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT};
    VkPhysicalDeviceMemoryProperties2 memory = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                                                .pNext = &budgets};
    vkGetPhysicalDeviceMemoryProperties2(physical, &memory);
    *heap_size = memory.memoryProperties.memoryHeaps[0].size;
    *budget = budgets.heapBudget[0];
    *usage = budgets.heapUsage[0];
}

/* Allocate chunks of one memory type until refused: how much was obtained, and the refusal. held[] ends with
 * VK_NULL_HANDLE where it was refused. */
static VkDeviceSize fill_in(VkDevice device, uint32_t type, VkDeviceSize chunk, VkResult *refusal,
                            VkDeviceMemory *held, int room)
{
    VkDeviceSize total = 0;
    *refusal = VK_SUCCESS;
    for (int i = 0; i < room; i++) {
        VkResult result = allocate_in(device, type, chunk, NULL, &held[i]);
        if (result != VK_SUCCESS) {
            *refusal = result;
            held[i] = VK_NULL_HANDLE;
            break;
        }
        total += chunk;
    }
    return total;
}

static VkDeviceSize fill(VkDevice device, VkDeviceSize chunk, VkResult *refusal, VkDeviceMemory *held, int room)
{
    return fill_in(device, 0, chunk, refusal, held, room);
}

/* Free what fill_in obtained. */
static void free_held(VkDevice device, VkDeviceMemory *held, int room)
{
    for (int i = 0; i < room && held[i] != VK_NULL_HANDLE; i++) {
        vkFreeMemory(device, held[i], NULL);
        held[i] = VK_NULL_HANDLE;
    }
}

/* -- scenarios ------------------------------------------------------------------------------------------------- */

/* Twenty instances alive at once: each enumerates its GPU and creates a device. */
static void many_instances(void)
{
    enum { COUNT = 20 };
    VkInstance instances[COUNT];
    for (int i = 0; i < COUNT; i++) {
        instances[i] = make_instance();
        if (instances[i] == VK_NULL_HANDLE) {
            return;
        }
    }
    for (int i = 0; i < COUNT; i++) {
        VkPhysicalDevice physical = first_gpu(instances[i]);
        VkDevice device = make_device(physical, NULL, 0);
        VkDeviceMemory memory;
        CHECK(allocate(device, MIB, NULL, &memory) == VK_SUCCESS, "instance %d: allocating 1 MiB failed", i);
        vkFreeMemory(device, memory, NULL);
        vkDestroyDevice(device, NULL);
    }
    for (int i = COUNT - 1; i >= 0; i--) {
        vkDestroyInstance(instances[i], NULL);
    }
}

/* Seventy devices alive at once: each allocates, and creates and binds a buffer. */
static void many_devices(void)
{
    enum { COUNT = 70 };
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    VkDevice devices[COUNT];
    VkDeviceMemory memories[COUNT];
    VkBuffer buffers[COUNT];
    for (int i = 0; i < COUNT; i++) {
        devices[i] = make_device(physical, NULL, 0);
        if (devices[i] == VK_NULL_HANDLE) {
            return;
        }
    }
    for (int i = 0; i < COUNT; i++) {
        VkResult result = allocate(devices[i], MIB, NULL, &memories[i]);
        CHECK(result == VK_SUCCESS, "device %d: vkAllocateMemory: %d", i, result);
        VkBufferCreateInfo info = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, .size = MIB,
                                   .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT};
        result = vkCreateBuffer(devices[i], &info, NULL, &buffers[i]);
        CHECK(result == VK_SUCCESS, "device %d: vkCreateBuffer: %d", i, result);
        CHECK(vkBindBufferMemory(devices[i], buffers[i], memories[i], 0) == VK_SUCCESS, "device %d: bind", i);
    }
    for (int i = 0; i < COUNT; i++) {
        vkDestroyBuffer(devices[i], buffers[i], NULL);
        vkFreeMemory(devices[i], memories[i], NULL);
        vkDestroyDevice(devices[i], NULL);
    }
    vkDestroyInstance(instance, NULL);
}

/* Without a slice (no env, or one that does not parse): the budget the loader advertises is a real one, and a device
 * that enables it is created. */
static void pass_through_budget(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    int times = 0;
    if (has_device_extension(physical, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME, &times)) {
        CHECK(times == 1, "VK_EXT_memory_budget listed %d times", times);
        VkDeviceSize heap, budget, usage;
        budget_of(physical, &heap, &budget, &usage);
        CHECK(budget > 0 && budget <= heap, "heap 0: budget %llu of %llu", (unsigned long long)budget,
              (unsigned long long)heap);
        const char *extensions[] = {VK_EXT_MEMORY_BUDGET_EXTENSION_NAME};
        VkDevice device = make_device(physical, extensions, 1);
        vkDestroyDevice(device, NULL);
    }
    vkDestroyInstance(instance, NULL);
}

/* In a slice: the heap and the budget are the slice's, and allocation stops at its edge with the driver's own
 * out-of-memory error. */
static void slice_edge(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    int times = 0;
    CHECK(has_device_extension(physical, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME, &times) && times == 1,
          "VK_EXT_memory_budget listed %d times", times);
    VkDeviceSize heap, budget, usage;
    budget_of(physical, &heap, &budget, &usage);
    CHECK(heap <= SLICE_MIB * MIB, "heap 0 is %llu MiB", (unsigned long long)(heap / MIB));
    CHECK(budget > 0 && budget <= SLICE_MIB * MIB, "budget %llu MiB", (unsigned long long)(budget / MIB));
    const char *extensions[] = {VK_EXT_MEMORY_BUDGET_EXTENSION_NAME};
    VkDevice device = make_device(physical, extensions, 1);
    VkDeviceMemory held[64];
    VkResult refusal;
    VkDeviceSize obtained = fill(device, 16 * MIB, &refusal, held, 64);
    CHECK(refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY, "refused with %d", refusal);
    CHECK(obtained <= SLICE_MIB * MIB && obtained >= (SLICE_MIB - 16) * MIB, "obtained %llu MiB",
          (unsigned long long)(obtained / MIB));
    for (int i = 0; i < 64 && held[i] != VK_NULL_HANDLE; i++) {
        vkFreeMemory(device, held[i], NULL);
    }
    budget_of(physical, &heap, &budget, &usage);
    CHECK(usage == 0, "usage %llu after every free", (unsigned long long)usage);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* Memory exported as an fd and imported again is one object, charged once, while either handle holds it. */
static struct ledger_shared *observe(void);
static int64_t total_becomes(int64_t expected);
static int64_t total_after_a_while(void);

static void exported_memory(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    if (!has_device_extension(physical, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME, NULL)) {
        printf("%s: skipped: the driver has no VK_KHR_external_memory_fd\n", scenario_name);
        vkDestroyInstance(instance, NULL);
        return;
    }
    const char *extensions[] = {VK_KHR_EXTERNAL_MEMORY_EXTENSION_NAME, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME};
    VkDevice device = make_device(physical, extensions, 2);
    PFN_vkGetMemoryFdKHR get_fd = (PFN_vkGetMemoryFdKHR)vkGetDeviceProcAddr(device, "vkGetMemoryFdKHR");
    CHECK(get_fd != NULL, "no vkGetMemoryFdKHR");
    VkExportMemoryAllocateInfo export = {.sType = VK_STRUCTURE_TYPE_EXPORT_MEMORY_ALLOCATE_INFO,
                                         .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
    VkDeviceMemory memory;
    VkResult result = allocate(device, 200 * MIB, &export, &memory);
    CHECK(result == VK_SUCCESS, "allocating 200 MiB to export: %d", result);
    VkMemoryGetFdInfoKHR info = {.sType = VK_STRUCTURE_TYPE_MEMORY_GET_FD_INFO_KHR, .memory = memory,
                                 .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
    int fd = -1;
    if (get_fd != NULL) {
        CHECK(get_fd(device, &info, &fd) == VK_SUCCESS && fd >= 0, "vkGetMemoryFdKHR");
    }
    VkImportMemoryFdInfoKHR import = {.sType = VK_STRUCTURE_TYPE_IMPORT_MEMORY_FD_INFO_KHR,
                                      .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT, .fd = fd};
    VkDeviceMemory again = VK_NULL_HANDLE;
    result = fd >= 0 ? allocate(device, 200 * MIB, &import, &again) : VK_ERROR_INVALID_EXTERNAL_HANDLE;
    CHECK(result == VK_SUCCESS, "importing the exported memory: %d", result);
    if (result != VK_SUCCESS && fd >= 0) {
        close(fd);
    }
    int64_t total = total_after_a_while();
    CHECK(total == (int64_t)(200 * MIB), "total %lld MiB with the memory exported and imported",
          (long long)(total / (int64_t)MIB));
    VkDeviceMemory more;
    result = allocate(device, 100 * MIB, NULL, &more);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "100 MiB more beside the 200 MiB object: %d", result);
    if (result == VK_SUCCESS) {
        vkFreeMemory(device, more, NULL);
    }
    /* The exporter's handle freed: the import still holds the object. */
    vkFreeMemory(device, memory, NULL);
    total = total_after_a_while();
    CHECK(total == (int64_t)(200 * MIB), "total %lld MiB with the import alone held",
          (long long)(total / (int64_t)MIB));
    if (again != VK_NULL_HANDLE) {
        vkFreeMemory(device, again, NULL);
    }
    total = total_becomes(0);
    CHECK(total == 0, "total %lld once both handles were freed", (long long)total);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* Hold 100 MiB until killed (two at once, then SIGKILLed: see main). */
static void hold(void)
{
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkDeviceMemory memory;
    VkResult result = allocate(device, 100 * MIB, NULL, &memory);
    CHECK(result == VK_SUCCESS, "allocating 100 MiB: %d", result);
    if (failures == 0) {
        pause();
    }
}

/* What killed processes held is in no later process's budget, before anything is refused. */
static void budget_after_kills(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    VkDeviceSize heap, budget, usage;
    budget_of(physical, &heap, &budget, &usage);
    CHECK(usage == 0, "usage %llu MiB after its holders were killed", (unsigned long long)(usage / MIB));
    CHECK(budget >= (SLICE_MIB - 1) * MIB, "budget %llu MiB after its holders were killed",
          (unsigned long long)(budget / MIB));
    vkDestroyInstance(instance, NULL);
}

/* A submit's wait and a batch's charge, with a compute share: many batches in flight, none refused. */
static void throttled_submits(void)
{
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkQueue queue;
    vkGetDeviceQueue(device, 0, 0, &queue);
    for (int i = 0; i < 200; i++) {
        VkResult result = vkQueueSubmit(queue, 0, NULL, VK_NULL_HANDLE);
        CHECK(result == VK_SUCCESS, "empty submit %d: %d", i, result);
    }
    VkSubmitInfo submit = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO};
    for (int i = 0; i < 200; i++) {
        VkResult result = vkQueueSubmit(queue, 1, &submit, VK_NULL_HANDLE);
        CHECK(result == VK_SUCCESS, "submit %d: %d", i, result);
    }
    CHECK(vkQueueWaitIdle(queue) == VK_SUCCESS, "vkQueueWaitIdle");
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* -- the fake driver: what it was told, what an application sees of its GPUs, and what reached it --------------- */

/* A size the fake driver was given (bytes, or with K, M or G), 0 where it was not. */
static VkDeviceSize setting_size(const char *name)
{
    const char *value = getenv(name);
    if (value == NULL) {
        return 0;
    }
    char *end = NULL;
    VkDeviceSize size = strtoull(value, &end, 10);
    switch (*end) {
    case 'K': return size << 10;
    case 'M': return size << 20;
    case 'G': return size << 30;
    default: return size;
    }
}

static bool driver_budget(void)
{
    const char *value = getenv("FAKE_ICD_BUDGET");
    return value != NULL && strcmp(value, "1") == 0;
}

/* What reached the fake driver for one of its GPUs: read from the library the loader loaded, not from a copy. */
static struct fake_icd_stats driver_saw(uint32_t gpu)
{
    static fake_icd_stats_function get;
    struct fake_icd_stats stats;
    memset(&stats, 0, sizeof stats);
    if (get == NULL) {
        const char *library = getenv("HARNESS_FAKE_ICD_LIBRARY");
        void *handle = library != NULL ? dlopen(library, RTLD_NOW | RTLD_NOLOAD) : NULL;
        CHECK(handle != NULL, "the fake driver %s is not the one the loader loaded", library ? library : "(unset)");
        if (handle == NULL) {
            return stats;
        }
        get = (fake_icd_stats_function)dlsym(handle, FAKE_ICD_STATS_SYMBOL);
        CHECK(get != NULL, "the fake driver has no %s", FAKE_ICD_STATS_SYMBOL);
    }
    CHECK(get != NULL && get(gpu, &stats), "the fake driver has no GPU %u", gpu);
    return stats;
}

/* Nothing the driver could not have served reached it, and it holds nothing: checked at each scenario's end. */
static void driver_clean(uint32_t gpus)
{
    for (uint32_t gpu = 0; gpu < gpus; gpu++) {
        struct fake_icd_stats stats = driver_saw(gpu);
        CHECK(stats.bad_calls == 0, "GPU %u: %llu calls the driver could not have served", gpu,
              (unsigned long long)stats.bad_calls);
        for (int heap = 0; heap < FAKE_ICD_MAX_HEAPS; heap++) {
            CHECK(stats.in_use[heap] == 0, "GPU %u heap %d: the driver still holds %llu MiB", gpu, heap,
                  (unsigned long long)(stats.in_use[heap] / MIB));
        }
    }
}

/* What an application sees of one GPU, through the layer. */
struct view {
    int gpu; /* the fake GPU, by its UUID; -1: not one of the fake driver's */
    VkPhysicalDeviceProperties properties;
    VkDeviceSize max_allocation_11, max_allocation_m3; /* Vulkan11Properties, Maintenance3Properties */
    VkDeviceSize max_buffer_13, max_buffer_m4;         /* Vulkan13Properties, Maintenance4Properties */
    bool pci_listed;
    VkPhysicalDevicePCIBusInfoPropertiesEXT pci;
    VkPhysicalDeviceMemoryProperties memory;
    VkPhysicalDeviceMemoryBudgetPropertiesEXT budget;
};

static struct view look(VkPhysicalDevice physical)
{
    struct view view;
    memset(&view, 0, sizeof view);
    view.pci_listed = has_device_extension(physical, VK_EXT_PCI_BUS_INFO_EXTENSION_NAME, NULL);
    int times = 0;
    CHECK(has_device_extension(physical, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME, &times) && times == 1,
          "VK_EXT_memory_budget listed %d times", times);
    /* The 1.1 structures one by one, then the same as Vulkan11Properties: a chain may not hold both. */
    VkPhysicalDevicePCIBusInfoPropertiesEXT pci = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT};
    VkPhysicalDeviceMaintenance4Properties m4 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES,
                                                 .pNext = view.pci_listed ? &pci : NULL};
    VkPhysicalDeviceMaintenance3Properties m3 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES,
                                                 .pNext = &m4};
    VkPhysicalDeviceIDProperties id = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES, .pNext = &m3};
    VkPhysicalDeviceProperties2 properties = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &id};
    vkGetPhysicalDeviceProperties2(physical, &properties);
    VkPhysicalDeviceVulkan13Properties v13 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_PROPERTIES};
    VkPhysicalDeviceVulkan11Properties v11 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES,
                                              .pNext = &v13};
    VkPhysicalDeviceProperties2 properties11 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                                .pNext = &v11};
    vkGetPhysicalDeviceProperties2(physical, &properties11);
    view.gpu = fake_icd_gpu_of(id.deviceUUID);
    CHECK(view.gpu >= 0, "a GPU that is not the fake driver's: %s", properties.properties.deviceName);
    CHECK(memcmp(id.deviceUUID, v11.deviceUUID, VK_UUID_SIZE) == 0, "two UUIDs for one GPU");
    view.properties = properties.properties;
    view.max_allocation_11 = v11.maxMemoryAllocationSize;
    view.max_allocation_m3 = m3.maxMemoryAllocationSize;
    view.max_buffer_13 = v13.maxBufferSize;
    view.max_buffer_m4 = m4.maxBufferSize;
    view.pci = pci;

    view.budget.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT;
    VkPhysicalDeviceMemoryProperties2 memory = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                                                .pNext = &view.budget};
    vkGetPhysicalDeviceMemoryProperties2(physical, &memory);
    view.memory = memory.memoryProperties;
    view.budget.pNext = NULL;
    /* The 1.0 call says the same. */
    VkPhysicalDeviceMemoryProperties plain;
    vkGetPhysicalDeviceMemoryProperties(physical, &plain);
    CHECK(plain.memoryHeapCount == view.memory.memoryHeapCount, "%u heaps, and %u", plain.memoryHeapCount,
          view.memory.memoryHeapCount);
    for (uint32_t heap = 0; heap < plain.memoryHeapCount && heap < VK_MAX_MEMORY_HEAPS; heap++) {
        CHECK(plain.memoryHeaps[heap].size == view.memory.memoryHeaps[heap].size,
              "heap %u: %llu MiB by vkGetPhysicalDeviceMemoryProperties, %llu by its 2", heap,
              (unsigned long long)(plain.memoryHeaps[heap].size / MIB),
              (unsigned long long)(view.memory.memoryHeaps[heap].size / MIB));
    }
    return view;
}

/* One heap as an application sees it: its size, its budget and its usage, each exactly. */
static void expect_heap(const struct view *view, uint32_t heap, VkDeviceSize size, VkDeviceSize budget,
                        VkDeviceSize usage)
{
    CHECK(heap < view->memory.memoryHeapCount, "GPU %d has no heap %u", view->gpu, heap);
    if (heap >= view->memory.memoryHeapCount) {
        return;
    }
    CHECK(view->memory.memoryHeaps[heap].size == size, "GPU %d heap %u: %llu MiB, not %llu", view->gpu, heap,
          (unsigned long long)(view->memory.memoryHeaps[heap].size / MIB), (unsigned long long)(size / MIB));
    CHECK(view->budget.heapBudget[heap] == budget, "GPU %d heap %u: a budget of %llu MiB, not %llu", view->gpu,
          heap, (unsigned long long)(view->budget.heapBudget[heap] / MIB), (unsigned long long)(budget / MIB));
    CHECK(view->budget.heapUsage[heap] == usage, "GPU %d heap %u: %llu MiB in use, not %llu", view->gpu, heap,
          (unsigned long long)(view->budget.heapUsage[heap] / MIB), (unsigned long long)(usage / MIB));
}

/* The largest allocation and buffer an application is told it may make. */
static void expect_limits(const struct view *view, VkDeviceSize largest)
{
    CHECK(view->max_allocation_11 == largest && view->max_allocation_m3 == largest,
          "GPU %d: maxMemoryAllocationSize %llu and %llu MiB, not %llu", view->gpu,
          (unsigned long long)(view->max_allocation_11 / MIB), (unsigned long long)(view->max_allocation_m3 / MIB),
          (unsigned long long)(largest / MIB));
    CHECK(view->max_buffer_13 == largest && view->max_buffer_m4 == largest,
          "GPU %d: maxBufferSize %llu and %llu MiB, not %llu", view->gpu,
          (unsigned long long)(view->max_buffer_13 / MIB), (unsigned long long)(view->max_buffer_m4 / MIB),
          (unsigned long long)(largest / MIB));
}

/* Every GPU the application may see, at most room of them. */
static uint32_t all_gpus(VkInstance instance, VkPhysicalDevice *out, uint32_t room)
{
    uint32_t count = 0;
    VkResult result = vkEnumeratePhysicalDevices(instance, &count, NULL);
    CHECK(result == VK_SUCCESS, "vkEnumeratePhysicalDevices: %d", result);
    CHECK(count <= room, "%u GPUs", count);
    count = count < room ? count : room;
    result = vkEnumeratePhysicalDevices(instance, &count, out);
    CHECK(result == VK_SUCCESS, "vkEnumeratePhysicalDevices: %d", result);
    return count;
}

/* The groups hold exactly the GPUs enumerated, each once (the fake driver makes each GPU a group of its own). */
static void expect_groups(VkInstance instance, const VkPhysicalDevice *gpus, uint32_t count)
{
    uint32_t groups = 0;
    VkResult result = vkEnumeratePhysicalDeviceGroups(instance, &groups, NULL);
    CHECK(result == VK_SUCCESS && groups == count, "vkEnumeratePhysicalDeviceGroups: %d, %u groups of %u GPUs",
          result, groups, count);
    VkPhysicalDeviceGroupProperties properties[FAKE_ICD_MAX_GPUS];
    groups = groups < FAKE_ICD_MAX_GPUS ? groups : FAKE_ICD_MAX_GPUS;
    for (uint32_t i = 0; i < groups; i++) {
        properties[i] = (VkPhysicalDeviceGroupProperties){.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_GROUP_PROPERTIES};
    }
    result = vkEnumeratePhysicalDeviceGroups(instance, &groups, properties);
    CHECK(result == VK_SUCCESS, "vkEnumeratePhysicalDeviceGroups: %d", result);
    for (uint32_t i = 0; i < groups; i++) {
        CHECK(properties[i].physicalDeviceCount == 1, "group %u has %u GPUs", i, properties[i].physicalDeviceCount);
        int found = 0;
        for (uint32_t j = 0; j < count; j++) {
            found += properties[i].physicalDevices[0] == gpus[j];
        }
        CHECK(found == 1, "group %u holds a GPU that was not enumerated", i);
    }
}

static VkDevice device_with_budget(VkPhysicalDevice physical)
{
    const char *extensions[] = {VK_EXT_MEMORY_BUDGET_EXTENSION_NAME};
    return make_device(physical, extensions, 1);
}

/* No slice applies (none, one that does not parse, whole GPUs): two discrete GPUs, each exactly as the driver
 * describes it, and every allocation the driver would serve served; what is refused, the driver refused. */
static void fake_pass_through(void)
{
    bool native = driver_budget();
    VkDeviceSize elsewhere = setting_size("FAKE_ICD_ELSEWHERE");
    VkInstance instance = make_instance();
    VkPhysicalDevice gpus[FAKE_ICD_MAX_GPUS];
    uint32_t count = all_gpus(instance, gpus, FAKE_ICD_MAX_GPUS);
    CHECK(count == 2, "%u GPUs enumerated, not both", count);
    expect_groups(instance, gpus, count);
    bool seen[2] = {false, false};
    for (uint32_t i = 0; i < count; i++) {
        struct view view = look(gpus[i]);
        if (view.gpu < 0 || view.gpu > 1) {
            continue;
        }
        CHECK(!seen[view.gpu], "GPU %d enumerated twice", view.gpu);
        seen[view.gpu] = true;
        CHECK(view.properties.vendorID == 0x1234 && view.properties.deviceID == 0x5678, "ids %x:%x",
              view.properties.vendorID, view.properties.deviceID);
        CHECK(view.properties.deviceType == VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU, "type %d",
              view.properties.deviceType);
        CHECK(view.pci_listed && view.pci.pciDomain == 0 && view.pci.pciBus == 3u + (uint32_t)view.gpu &&
                  view.pci.pciDevice == 0 && view.pci.pciFunction == 0,
              "GPU %d at %04x:%02x:%02x.%x", view.gpu, view.pci.pciDomain, view.pci.pciBus, view.pci.pciDevice,
              view.pci.pciFunction);
        CHECK(view.memory.memoryHeapCount == 2 && view.memory.memoryTypeCount == 2, "%u heaps, %u types",
              view.memory.memoryHeapCount, view.memory.memoryTypeCount);
        CHECK(view.memory.memoryHeaps[0].flags == VK_MEMORY_HEAP_DEVICE_LOCAL_BIT &&
                  view.memory.memoryHeaps[1].flags == 0,
              "heap flags %x and %x", view.memory.memoryHeaps[0].flags, view.memory.memoryHeaps[1].flags);
        /* The driver's own budget where it has one; where it has none, as a driver that knows nothing more. */
        expect_heap(&view, 0, 8 * GIB, native ? 8 * GIB - elsewhere : 8 * GIB, 0);
        expect_heap(&view, 1, 16 * GIB, native ? 16 * GIB - elsewhere : 16 * GIB, 0);
        expect_limits(&view, 16 * GIB);
    }
    for (uint32_t i = 0; i < count; i++) {
        struct view view = look(gpus[i]);
        if (view.gpu < 0) {
            continue;
        }
        uint32_t gpu = (uint32_t)view.gpu;
        VkDevice device = device_with_budget(gpus[i]);
        struct fake_icd_stats before = driver_saw(gpu);
        /* The driver's extension is the driver's: enabled on it where it has it, never where it has not. */
        CHECK(before.devices == 1 && before.budget_enabled == (native ? 1u : 0u),
              "GPU %u: %llu devices, %llu with VK_EXT_memory_budget", gpu, (unsigned long long)before.devices,
              (unsigned long long)before.budget_enabled);
        VkDeviceMemory held[16], host[2] = {VK_NULL_HANDLE, VK_NULL_HANDLE};
        VkResult refusal;
        VkDeviceSize obtained = fill_in(device, 0, GIB, &refusal, held, 16);
        CHECK(obtained == 8 * GIB && refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY,
              "GPU %u: %llu MiB of the device heap's 8 GiB, then %d", gpu, (unsigned long long)(obtained / MIB),
              refusal);
        VkResult result = allocate_in(device, 1, 16 * GIB, NULL, &host[0]);
        CHECK(result == VK_SUCCESS, "GPU %u: the whole host heap: %d", gpu, result);
        result = allocate_in(device, 1, 1, NULL, &host[1]);
        CHECK(result == VK_ERROR_OUT_OF_HOST_MEMORY, "GPU %u: a byte past the host heap: %d", gpu, result);
        struct fake_icd_stats after = driver_saw(gpu);
        /* Eight chunks and the ninth, the host heap and the byte past it: all reached the driver, which refused
         * the two it had no room for. */
        CHECK(after.allocations - before.allocations == 11 && after.refusals - before.refusals == 2,
              "GPU %u: %llu allocations reached the driver, %llu refused by it", gpu,
              (unsigned long long)(after.allocations - before.allocations),
              (unsigned long long)(after.refusals - before.refusals));
        struct view full = look(gpus[i]);
        expect_heap(&full, 0, 8 * GIB, native ? 8 * GIB - elsewhere : 8 * GIB, native ? 8 * GIB : 0);
        expect_heap(&full, 1, 16 * GIB, native ? 16 * GIB - elsewhere : 16 * GIB, native ? 16 * GIB : 0);
        free_held(device, held, 16);
        vkFreeMemory(device, host[0], NULL);
        vkDestroyDevice(device, NULL);
    }
    CHECK(count != 2 || (seen[0] && seen[1]), "not both GPUs seen");
    driver_clean(2);
    vkDestroyInstance(instance, NULL);
}

/* A driver with its own VK_EXT_memory_budget, under a slice: the heap and the budget are the slice's, never more
 * than the driver's budget; usage is what this process holds; the host heap of a discrete GPU is the driver's. */
static void fake_own_budget(void)
{
    const VkDeviceSize slice = SLICE_MIB * MIB, heap = GIB, host_heap = 4 * GIB;
    VkDeviceSize elsewhere = setting_size("FAKE_ICD_ELSEWHERE");
    VkDeviceSize driver = heap - elsewhere;
    VkDeviceSize expected = slice < driver ? slice : driver;
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    struct view view = look(physical);
    expect_heap(&view, 0, slice, expected, 0);
    expect_heap(&view, 1, host_heap, host_heap - elsewhere, 0);
    expect_limits(&view, slice);

    VkDevice device = device_with_budget(physical);
    struct fake_icd_stats saw = driver_saw(0);
    CHECK(saw.budget_enabled == 1, "the driver's VK_EXT_memory_budget was not enabled on it");
    VkDeviceMemory first, host;
    CHECK(allocate_in(device, 0, 64 * MIB, NULL, &first) == VK_SUCCESS, "64 MiB of the device heap");
    CHECK(allocate_in(device, 1, 32 * MIB, NULL, &host) == VK_SUCCESS, "32 MiB of the host heap");
    view = look(physical);
    expect_heap(&view, 0, slice, expected, 64 * MIB);
    expect_heap(&view, 1, host_heap, host_heap - elsewhere, 32 * MIB);
    saw = driver_saw(0);
    CHECK(saw.in_use[0] == 64 * MIB && saw.in_use[1] == 32 * MIB, "the driver holds %llu and %llu MiB",
          (unsigned long long)(saw.in_use[0] / MIB), (unsigned long long)(saw.in_use[1] / MIB));

    /* To the slice's edge: whatever the driver's budget, the slice's memory is obtained, and no more. */
    VkDeviceMemory held[16];
    VkResult refusal;
    VkDeviceSize obtained = fill_in(device, 0, 64 * MIB, &refusal, held, 16);
    CHECK(obtained == slice - 64 * MIB && refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY, "%llu MiB more, then %d",
          (unsigned long long)(obtained / MIB), refusal);
    saw = driver_saw(0);
    CHECK(saw.allocations == 2 + (slice - 64 * MIB) / (64 * MIB) && saw.refusals == 0,
          "%llu allocations reached the driver, %llu refused by it: the layer's refusal went down",
          (unsigned long long)saw.allocations, (unsigned long long)saw.refusals);
    view = look(physical);
    expect_heap(&view, 0, slice, expected, slice);
    free_held(device, held, 16);
    vkFreeMemory(device, first, NULL);
    vkFreeMemory(device, host, NULL);
    view = look(physical);
    expect_heap(&view, 0, slice, expected, 0);
    expect_heap(&view, 1, host_heap, host_heap - elsewhere, 0);
    vkDestroyDevice(device, NULL);
    driver_clean(1);
    vkDestroyInstance(instance, NULL);
}

/* A discrete GPU with a device-local heap, a resizable BAR beside it and a host heap, under a 1 GiB slice: the
 * device-local heaps count (one budget for both), the host heap is the driver's. The driver never sees an
 * allocation the layer refused. */
static void fake_discrete_slice(void)
{
    const VkDeviceSize slice = GIB, bar = 256 * MIB, host_heap = 16 * GIB;
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    struct view view = look(physical);
    CHECK(view.memory.memoryHeapCount == 3, "%u heaps", view.memory.memoryHeapCount);
    CHECK(view.memory.memoryHeaps[0].flags == VK_MEMORY_HEAP_DEVICE_LOCAL_BIT &&
              view.memory.memoryHeaps[1].flags == VK_MEMORY_HEAP_DEVICE_LOCAL_BIT &&
              view.memory.memoryHeaps[2].flags == 0,
          "heap flags changed");
    expect_heap(&view, 0, slice, slice, 0);
    expect_heap(&view, 1, bar, bar, 0);
    expect_heap(&view, 2, host_heap, host_heap, 0);
    expect_limits(&view, slice);

    VkDevice device = device_with_budget(physical);
    CHECK(driver_saw(0).budget_enabled == 0, "VK_EXT_memory_budget was enabled on a driver without it");
    VkDeviceMemory memory;
    VkResult result = allocate_in(device, 0, 2 * slice, NULL, &memory);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "twice the slice at once: %d", result);
    CHECK(driver_saw(0).allocations == 0, "the driver saw an allocation the layer refused");

    VkDeviceMemory held[16];
    VkResult refusal;
    VkDeviceSize obtained = fill_in(device, 0, 128 * MIB, &refusal, held, 16);
    CHECK(obtained == slice && refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY, "%llu MiB, then %d",
          (unsigned long long)(obtained / MIB), refusal);
    result = allocate_in(device, 0, 1, NULL, &memory);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "a byte past the slice: %d", result);
    result = allocate_in(device, 1, MIB, NULL, &memory);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "1 MiB of the BAR heap with the slice spent: %d", result);
    struct fake_icd_stats saw = driver_saw(0);
    CHECK(saw.allocations == 8 && saw.refusals == 0 && saw.in_use[0] == slice,
          "the driver saw %llu allocations, refused %llu, holds %llu MiB", (unsigned long long)saw.allocations,
          (unsigned long long)saw.refusals, (unsigned long long)(saw.in_use[0] / MIB));
    view = look(physical);
    expect_heap(&view, 0, slice, slice, slice);
    expect_heap(&view, 1, bar, 0, 0);

    /* The host heap is not the slice's: all of it, and past it the driver's own refusal. */
    VkDeviceMemory host;
    result = allocate_in(device, 2, host_heap, NULL, &host);
    CHECK(result == VK_SUCCESS, "the whole host heap: %d", result);
    result = allocate_in(device, 2, 1, NULL, &memory);
    CHECK(result == VK_ERROR_OUT_OF_HOST_MEMORY, "a byte past the host heap: %d", result);
    saw = driver_saw(0);
    CHECK(saw.allocations == 10 && saw.refusals == 1, "the driver saw %llu allocations, refused %llu",
          (unsigned long long)saw.allocations, (unsigned long long)saw.refusals);

    /* What is freed of one device-local heap is the other's to take. */
    vkFreeMemory(device, held[0], NULL);
    held[0] = held[7];
    held[7] = VK_NULL_HANDLE;
    result = allocate_in(device, 1, 128 * MIB, NULL, &memory);
    CHECK(result == VK_SUCCESS, "128 MiB of the BAR heap after 128 MiB was freed: %d", result);
    view = look(physical);
    expect_heap(&view, 0, slice, slice - 128 * MIB, slice - 128 * MIB);
    expect_heap(&view, 1, bar, 128 * MIB, 128 * MIB);
    if (result == VK_SUCCESS) {
        vkFreeMemory(device, memory, NULL);
    }
    free_held(device, held, 16);
    vkFreeMemory(device, host, NULL);
    view = look(physical);
    expect_heap(&view, 0, slice, slice, 0);
    expect_heap(&view, 1, bar, bar, 0);
    vkDestroyDevice(device, NULL);
    driver_clean(1);
    vkDestroyInstance(instance, NULL);
}

/* An integrated GPU, whose heaps are all the same memory: every heap counts, their sizes shared out so that
 * together they are the slice (4 GiB and 8 GiB under 768 MiB: 256 and 512 MiB), one budget for all of them. */
static void fake_integrated_slice(void)
{
    const VkDeviceSize slice = 768 * MIB;
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    struct view view = look(physical);
    CHECK(view.properties.deviceType == VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU, "type %d",
          view.properties.deviceType);
    expect_heap(&view, 0, 256 * MIB, 256 * MIB, 0);
    expect_heap(&view, 1, 512 * MIB, 512 * MIB, 0);
    expect_limits(&view, slice);
    VkDevice device = make_device(physical, NULL, 0);
    VkDeviceMemory device_local, host, memory;
    CHECK(allocate_in(device, 0, 256 * MIB, NULL, &device_local) == VK_SUCCESS, "256 MiB of heap 0");
    CHECK(allocate_in(device, 1, 512 * MIB, NULL, &host) == VK_SUCCESS, "512 MiB of heap 1");
    VkResult result = allocate_in(device, 1, MIB, NULL, &memory);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "1 MiB of the host heap past the slice: %d", result);
    result = allocate_in(device, 0, MIB, NULL, &memory);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "1 MiB of the device heap past the slice: %d", result);
    struct fake_icd_stats saw = driver_saw(0);
    CHECK(saw.allocations == 2 && saw.refusals == 0, "the driver saw %llu allocations, refused %llu",
          (unsigned long long)saw.allocations, (unsigned long long)saw.refusals);
    view = look(physical);
    expect_heap(&view, 0, 256 * MIB, 256 * MIB, 256 * MIB);
    expect_heap(&view, 1, 512 * MIB, 512 * MIB, 512 * MIB);
    vkFreeMemory(device, device_local, NULL);
    vkFreeMemory(device, host, NULL);
    vkDestroyDevice(device, NULL);
    driver_clean(1);
    vkDestroyInstance(instance, NULL);
}

/* Three discrete GPUs (8 GiB device-local, 16 GiB host; a driver budget 2 GiB short of each) and a slice config:
 * what it names is seen and held to its slice, what it names whole is seen as the driver describes it, what it
 * does not name is not seen at all. */
#define GPUS 3

struct gpus_case {
    const char *name;
    const char *slices;
    bool pci;                /* the driver has VK_EXT_pci_bus_info (0000:03:00.0, 04 and 05) */
    long long budget[GPUS];  /* per GPU: -1 not seen, 0 whole (seen, not held), else its slice */
    bool one_slice;          /* any=: one slice, so one budget, for every GPU */
};
static const struct gpus_case gpus_cases[] = {
    {"gpus-one-by-pci", "pci:0000:04:00.0=1073741824", true, {-1, 1073741824, -1}, false},
    {"gpus-pci-and-whole", "pci:0000:03:00.0=1073741824,pci:0000:05:00.0=0", true, {1073741824, -1, 0}, false},
    {"gpus-two-slices", "pci:0000:05:00.0=536870912,pci:0000:03:00.0=1073741824", true,
     {1073741824, -1, 536870912}, false},
    {"gpus-by-uuid", "uuid:GPU-fa1ce000-0000-4000-8000-000000000001=1073741824", true, {-1, 1073741824, -1}, false},
    /* Without the driver's PCI addresses a PCI selector names nothing; a UUID still does. */
    {"gpus-no-pci-info", "pci:0000:03:00.0=1073741824,uuid:fa1ce000000040008000000000000002=536870912", false,
     {-1, -1, 536870912}, false},
    {"gpus-any", "any=1073741824", true, {1073741824, 1073741824, 1073741824}, true},
    {"gpus-none-named", "pci:0000:09:00.0=1073741824", true, {-1, -1, -1}, false},
};

static const struct gpus_case *gpus_case;

/* A setting the fake driver cannot parse: no GPU comes of it. */
static void fake_refuses_typos(void)
{
    VkApplicationInfo application = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO, .apiVersion = VK_API_VERSION_1_1};
    VkInstanceCreateInfo info = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, .pApplicationInfo = &application};
    VkInstance instance = VK_NULL_HANDLE;
    VkResult result = vkCreateInstance(&info, NULL, &instance);
    CHECK(result == VK_ERROR_INCOMPATIBLE_DRIVER, "vkCreateInstance: %d", result);
    if (result == VK_SUCCESS) {
        vkDestroyInstance(instance, NULL);
    }
}

static void several_gpus(void)
{
    const struct gpus_case *c = gpus_case;
    const VkDeviceSize heap = 8 * GIB, host_heap = 16 * GIB, elsewhere = 2 * GIB;
    VkInstance instance = make_instance();
    VkPhysicalDevice gpus[FAKE_ICD_MAX_GPUS];
    uint32_t count = all_gpus(instance, gpus, FAKE_ICD_MAX_GPUS);
    uint32_t expected = 0;
    for (int gpu = 0; gpu < GPUS; gpu++) {
        expected += c->budget[gpu] >= 0;
    }
    CHECK(count == expected, "%u GPUs seen, not %u", count, expected);
    expect_groups(instance, gpus, count);
    VkPhysicalDevice of[GPUS] = {VK_NULL_HANDLE, VK_NULL_HANDLE, VK_NULL_HANDLE};
    for (uint32_t i = 0; i < count; i++) {
        struct view view = look(gpus[i]);
        if (view.gpu < 0 || view.gpu >= GPUS) {
            continue;
        }
        long long budget = c->budget[view.gpu];
        CHECK(budget >= 0, "GPU %d is seen: the config does not name it", view.gpu);
        CHECK(of[view.gpu] == VK_NULL_HANDLE, "GPU %d seen twice", view.gpu);
        of[view.gpu] = gpus[i];
        CHECK(view.pci_listed == c->pci, "VK_EXT_pci_bus_info %s", view.pci_listed ? "listed" : "not listed");
        if (c->pci) {
            CHECK(view.pci.pciBus == 3u + (uint32_t)view.gpu, "GPU %d on bus %x", view.gpu, view.pci.pciBus);
        }
        VkDeviceSize slice = (VkDeviceSize)budget;
        if (budget > 0) {
            expect_heap(&view, 0, slice < heap ? slice : heap, slice < heap - elsewhere ? slice : heap - elsewhere, 0);
            expect_limits(&view, slice);
        } else {
            expect_heap(&view, 0, heap, heap - elsewhere, 0);
            expect_limits(&view, host_heap);
        }
        expect_heap(&view, 1, host_heap, host_heap - elsewhere, 0);
    }

    /* Each seen GPU filled in turn, the others' memory still held: each stops at its own slice (at the driver's
     * own refusal where whole), the slices of any= together at their one budget. */
    VkDevice devices[GPUS] = {VK_NULL_HANDLE, VK_NULL_HANDLE, VK_NULL_HANDLE};
    VkDeviceMemory held[GPUS][64];
    memset(held, 0, sizeof held);
    VkDeviceSize spent = 0;
    for (uint32_t gpu = 0; gpu < GPUS; gpu++) {
        if (of[gpu] == VK_NULL_HANDLE) {
            continue;
        }
        devices[gpu] = make_device(of[gpu], NULL, 0);
        struct fake_icd_stats before = driver_saw(gpu);
        VkResult refusal;
        VkDeviceSize obtained = fill_in(devices[gpu], 0, 256 * MIB, &refusal, held[gpu], 64);
        VkDeviceSize want = c->budget[gpu] == 0 ? heap
                            : c->one_slice       ? (VkDeviceSize)c->budget[gpu] - spent
                                                 : (VkDeviceSize)c->budget[gpu];
        spent += obtained;
        CHECK(obtained == want && refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY, "GPU %u: %llu MiB, not %llu, then %d",
              gpu, (unsigned long long)(obtained / MIB), (unsigned long long)(want / MIB), refusal);
        struct fake_icd_stats after = driver_saw(gpu);
        uint64_t driver_refused = c->budget[gpu] == 0 ? 1 : 0;
        CHECK(after.allocations - before.allocations == want / (256 * MIB) + driver_refused &&
                  after.refusals - before.refusals == driver_refused,
              "GPU %u: %llu allocations reached the driver, %llu refused by it", gpu,
              (unsigned long long)(after.allocations - before.allocations),
              (unsigned long long)(after.refusals - before.refusals));
    }
    if (c->one_slice && count > 1) {
        /* What one GPU gives back of the one budget, another may take. */
        uint32_t first = 0, last = GPUS - 1;
        free_held(devices[first], held[first], 64);
        VkResult refusal;
        VkDeviceSize obtained = fill_in(devices[last], 0, 256 * MIB, &refusal, held[last], 64);
        CHECK(obtained == (VkDeviceSize)c->budget[first] && refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY,
              "GPU %u: %llu MiB after GPU %u gave its memory back", last, (unsigned long long)(obtained / MIB),
              first);
    }
    for (uint32_t gpu = 0; gpu < GPUS; gpu++) {
        if (devices[gpu] != VK_NULL_HANDLE) {
            free_held(devices[gpu], held[gpu], 64);
            vkDestroyDevice(devices[gpu], NULL);
        }
        struct fake_icd_stats saw = driver_saw(gpu);
        CHECK(of[gpu] != VK_NULL_HANDLE || (saw.devices == 0 && saw.allocations == 0),
              "GPU %u is not seen, and the driver made %llu devices and saw %llu allocations on it", gpu,
              (unsigned long long)saw.devices, (unsigned long long)saw.allocations);
    }
    driver_clean(GPUS);
    vkDestroyInstance(instance, NULL);
}

static int64_t clock_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static char temporary[] = "/tmp/gpuppetti-harness-XXXXXX";
static char ledger_dir[sizeof temporary + 16];

/* -- the ledger: the daemon's, served by python -m gpuppetti.layer.ledgers for each scenario that has one ---------- */

/* A socket's address; false where the path does not fit one. */
static bool socket_address(const char *path, struct sockaddr_un *address)
{
    memset(address, 0, sizeof *address);
    address->sun_family = AF_UNIX;
    if (path == NULL || strlen(path) >= sizeof address->sun_path) {
        return false;
    }
    memcpy(address->sun_path, path, strlen(path) + 1);
    return true;
}

/* The ledger's own view, as any process of the allocation sees it: its shared page, through a connection that holds
 * nothing. */
static struct ledger_shared *observe_at(const char *path)
{
    struct sockaddr_un address;
    int fd = socket_address(path, &address) ? socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
    struct ledger_request hello = {.op = LEDGER_HELLO, .size = LEDGER_VERSION};
    struct ledger_answer answer;
    char control[CMSG_SPACE(sizeof(int))];
    struct iovec part = {.iov_base = &answer, .iov_len = sizeof answer};
    struct msghdr message = {.msg_iov = &part, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof control};
    int page = -1;
    if (fd >= 0 && connect(fd, (struct sockaddr *)&address, sizeof address) == 0 &&
        send(fd, &hello, sizeof hello, MSG_NOSIGNAL) == (ssize_t)sizeof hello &&
        recvmsg(fd, &message, MSG_WAITALL) == (ssize_t)sizeof answer && CMSG_FIRSTHDR(&message) != NULL) {
        memcpy(&page, CMSG_DATA(CMSG_FIRSTHDR(&message)), sizeof page);
    }
    void *map = page >= 0 ? mmap(NULL, LEDGER_SHARED_SIZE, PROT_READ, MAP_SHARED, page, 0) : MAP_FAILED;
    CHECK(map != MAP_FAILED, "the ledger at %s gave no page", path != NULL ? path : "(none)");
    if (page >= 0) {
        close(page);
    }
    if (fd >= 0) {
        close(fd);
    }
    return map != MAP_FAILED ? map : NULL;
}

static struct ledger_shared *observe(void)
{
    static struct ledger_shared *page;
    if (page == NULL) {
        page = observe_at(getenv("GPUPPETTI_VK_LEDGER"));
    }
    return page;
}

/* The slice's total as the ledger says it, once it is expected (one-way requests are taken in the daemon's time):
 * the last figure seen within two seconds. */
static int64_t total_on(struct ledger_shared *page, int64_t expected)
{
    int64_t total = -1;
    for (int tries = 0; page != NULL && tries < 200; tries++) {
        total = atomic_load(&page->slice[0].total);
        if (total == expected) {
            break;
        }
        usleep(10000);
    }
    return total;
}

static int64_t total_becomes(int64_t expected)
{
    return total_on(observe(), expected);
}

/* The total a while after something that must not change it. */
static int64_t total_after_a_while(void)
{
    usleep(200000);
    struct ledger_shared *page = observe();
    return page != NULL ? atomic_load(&page->slice[0].total) : -1;
}

static bool accepts(const char *path)
{
    struct sockaddr_un address;
    int fd = socket_address(path, &address) ? socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&address, sizeof address) == 0;
    if (fd >= 0) {
        close(fd);
    }
    return ok;
}

/* A ledger served at DIRECTORY/ledger.sock with these budgets (and shares), once it accepts; -1 where it does not
 * within ten seconds. HARNESS_LEDGER_PYTHON runs it, with HARNESS_LEDGER_PATH as its PYTHONPATH. */
static pid_t ledger_start(const char *directory, const char *budgets, const char *compute)
{
    const char *python = getenv("HARNESS_LEDGER_PYTHON");
    const char *path = getenv("HARNESS_LEDGER_PATH");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (path != NULL && *path != '\0') setenv("PYTHONPATH", path, 1);
        int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (null >= 0) dup2(null, STDOUT_FILENO);
        const char *python_ = python != NULL && *python != '\0' ? python : "python3";
        if (compute != NULL) {
            execlp(python_, python_, "-m", "gpuppetti.layer.ledgers", "serve", directory, "--budgets", budgets,
                   "--compute", compute, (char *)NULL);
        } else {
            execlp(python_, python_, "-m", "gpuppetti.layer.ledgers", "serve", directory, "--budgets", budgets,
                   (char *)NULL);
        }
        _exit(127);
    }
    char socket_path[512];
    snprintf(socket_path, sizeof socket_path, "%s/ledger.sock", directory);
    for (int tries = 0; pid > 0 && tries < 500; tries++) {
        if (accepts(socket_path)) {
            return pid;
        }
        if (waitpid(pid, NULL, WNOHANG) == pid) {
            break;
        }
        usleep(20000);
    }
    fprintf(stderr, "harness: no ledger served at %s (HARNESS_LEDGER_PYTHON=%s)\n", socket_path,
            python != NULL ? python : "");
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    return -1;
}

static void ledger_stop(pid_t pid, int signal_number)
{
    if (pid > 0) {
        kill(pid, signal_number);
        waitpid(pid, NULL, 0);
    }
}

/* -- what forks, exports, imports, reused handles and a daemon away do to the ledger ------------------------------ */

/* A forked child that frees a handle its parent allocated frees its copy: the parent's memory stays counted. */
static void fork_free(void)
{
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkDeviceMemory memory;
    VkResult result = allocate(device, 100 * MIB, NULL, &memory);
    CHECK(result == VK_SUCCESS, "allocating 100 MiB: %d", result);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        vkFreeMemory(device, memory, NULL);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child ended with status %d", status);
    int64_t total = total_after_a_while();
    CHECK(total == (int64_t)(100 * MIB), "total %lld after the child freed its copy", (long long)total);
    VkDeviceMemory more;
    result = allocate(device, 200 * MIB, NULL, &more);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "200 MiB more past a 256 MiB slice: %d", result);
    if (result == VK_SUCCESS) {
        vkFreeMemory(device, more, NULL);
    }
    vkFreeMemory(device, memory, NULL);
    /* A freed 100 MiB leaves at most LEDGER_SPARE_MAX with this process, for its next allocations. */
    total = total_becomes(LEDGER_SPARE_MAX);
    CHECK(total == LEDGER_SPARE_MAX, "total %lld after the parent freed it", (long long)total);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* A forked child has a connection of its own: when its parent is SIGKILLed, what the parent held is given back at
 * once, and what the child holds stays. */
static void fork_own_connection(void)
{
    int ready[2], done[2];
    CHECK(pipe(ready) == 0 && pipe(done) == 0, "pipe");
    fflush(NULL);
    pid_t parent = fork();
    if (parent == 0) {
        close(ready[0]);
        close(done[1]);
        VkInstance instance = make_instance();
        VkDevice device = make_device(first_gpu(instance), NULL, 0);
        VkDeviceMemory memory;
        if (allocate(device, 100 * MIB, NULL, &memory) != VK_SUCCESS) _exit(3);
        fflush(NULL);
        pid_t child = fork();
        if (child == 0) {
            VkDeviceMemory own;
            char byte = allocate(device, 50 * MIB, NULL, &own) == VK_SUCCESS ? 'y' : 'n';
            ssize_t wrote = write(ready[1], &byte, 1);
            ssize_t got = read(done[0], &byte, 1); /* until the scenario closes it */
            _exit(wrote == 1 && got >= 0 ? 0 : 1);
        }
        char byte = 'p';
        if (write(ready[1], &byte, 1) != 1) _exit(4);
        pause();
        _exit(0);
    }
    close(ready[1]);
    close(done[0]);
    char bytes[2] = {0, 0};
    CHECK(read(ready[0], &bytes[0], 1) == 1 && read(ready[0], &bytes[1], 1) == 1, "the parent and child are ready");
    CHECK(memchr(bytes, 'y', 2) != NULL && memchr(bytes, 'p', 2) != NULL, "the child's 50 MiB was refused: %.2s",
          bytes);
    int64_t total = total_becomes((int64_t)(150 * MIB));
    CHECK(total == (int64_t)(150 * MIB), "total %lld MiB with the parent's 100 and the child's 50",
          (long long)(total / (int64_t)MIB));
    kill(parent, SIGKILL);
    waitpid(parent, NULL, 0);
    total = total_becomes((int64_t)(50 * MIB));
    CHECK(total == (int64_t)(50 * MIB), "total %lld MiB once the parent was killed, the child alive",
          (long long)(total / (int64_t)MIB));
    close(done[1]);
    close(ready[0]);
    total = total_becomes(0);
    CHECK(total == 0, "total %lld once the child ended too", (long long)total);
}

/* Two processes share the slice to the byte: each gets its half, neither more; what one frees beyond its spare is
 * the other's, and all of it once it ends. */
static void shared_edge(void)
{
    const VkDeviceSize half = SLICE_MIB * MIB / 2;
    int ready[2], go[2];
    CHECK(pipe(ready) == 0 && pipe(go) == 0, "pipe");
    fflush(NULL);
    pid_t other = fork();
    if (other == 0) {
        close(ready[0]);
        close(go[1]);
        VkInstance instance = make_instance();
        VkDevice device = make_device(first_gpu(instance), NULL, 0);
        VkDeviceMemory memory;
        char byte = allocate(device, half, NULL, &memory) == VK_SUCCESS ? 'y' : 'n';
        if (write(ready[1], &byte, 1) != 1 || read(go[0], &byte, 1) != 1) _exit(1);
        vkFreeMemory(device, memory, NULL);
        byte = 'f';
        if (write(ready[1], &byte, 1) != 1) _exit(1);
        ssize_t got = read(go[0], &byte, 1); /* until the scenario closes it */
        _exit(got >= 0 ? 0 : 1);
    }
    close(ready[1]);
    close(go[0]);
    char byte = 0;
    CHECK(read(ready[0], &byte, 1) == 1 && byte == 'y', "the other process's half was refused");
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    VkDevice device = device_with_budget(physical);
    VkDeviceMemory mine, more;
    CHECK(allocate(device, half, NULL, &mine) == VK_SUCCESS, "this process's half, to the slice's edge");
    VkResult result = allocate(device, 1, NULL, &more);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "a byte past the edge: %d", result);
    if (result == VK_SUCCESS) vkFreeMemory(device, more, NULL);
    VkDeviceSize heap, budget, usage;
    budget_of(physical, &heap, &budget, &usage);
    CHECK(budget == SLICE_MIB * MIB && usage == SLICE_MIB * MIB, "budget %llu, usage %llu MiB at the edge",
          (unsigned long long)(budget / MIB), (unsigned long long)(usage / MIB));
    /* The other frees its half: it keeps its spare, the rest is this process's to take. */
    CHECK(write(go[1], "g", 1) == 1 && read(ready[0], &byte, 1) == 1 && byte == 'f', "the other freed its half");
    CHECK(total_becomes((int64_t)(half + LEDGER_SPARE_MAX)) == (int64_t)(half + LEDGER_SPARE_MAX),
          "the other's spare is what it keeps");
    result = allocate(device, half - LEDGER_SPARE_MAX, NULL, &more);
    CHECK(result == VK_SUCCESS, "what the other gave back: %d", result);
    VkDeviceMemory last;
    result = allocate(device, LEDGER_SPARE_MAX, NULL, &last);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "the other's spare, while it lives: %d", result);
    close(go[1]);
    waitpid(other, NULL, 0);
    close(ready[0]);
    CHECK(total_becomes((int64_t)(SLICE_MIB * MIB) - LEDGER_SPARE_MAX) == (int64_t)(SLICE_MIB * MIB) - LEDGER_SPARE_MAX,
          "the other ended: its spare is given back");
    result = allocate(device, LEDGER_SPARE_MAX, NULL, &last);
    CHECK(result == VK_SUCCESS, "the other's spare, once it ended: %d", result);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* A handle freed and handed out again at once (to another thread, in the driver's call) keeps the new record. */
static VkDevice reuse_device;
static VkDeviceMemory reuse_memory;

static void allocate_in_the_window(void)
{
    VkResult result = allocate(reuse_device, 32 * MIB, NULL, &reuse_memory);
    CHECK(result == VK_SUCCESS, "allocating 32 MiB while 64 MiB is freed: %d", result);
}

static void free_reuse(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    reuse_device = make_device(physical, NULL, 0);
    const char *library = getenv("HARNESS_FAKE_ICD_LIBRARY");
    void *handle = library != NULL ? dlopen(library, RTLD_NOW | RTLD_NOLOAD) : NULL;
    fake_icd_after_free_function after_free =
        handle != NULL ? (fake_icd_after_free_function)dlsym(handle, FAKE_ICD_AFTER_FREE_SYMBOL) : NULL;
    CHECK(after_free != NULL, "the fake driver has no %s", FAKE_ICD_AFTER_FREE_SYMBOL);
    VkDeviceMemory first;
    VkResult result = allocate(reuse_device, 64 * MIB, NULL, &first);
    CHECK(result == VK_SUCCESS, "allocating 64 MiB: %d", result);
    if (after_free != NULL && result == VK_SUCCESS) {
        after_free(allocate_in_the_window);
        vkFreeMemory(reuse_device, first, NULL);
        CHECK(reuse_memory == first, "the driver did not hand the handle out again");
        /* The 32 MiB were reserved before the 64 MiB were given back: the 64 MiB and the 32 MiB, then the 64 MiB
         * given back but the spare. */
        int64_t total = total_becomes((int64_t)(32 * MIB) + LEDGER_SPARE_MAX);
        CHECK(total == (int64_t)(32 * MIB) + LEDGER_SPARE_MAX, "total %lld bytes with the 32 MiB allocation alone "
              "held", (long long)total);
        vkFreeMemory(reuse_device, reuse_memory, NULL);
        total = total_becomes(LEDGER_SPARE_MAX);
        CHECK(total == LEDGER_SPARE_MAX, "total %lld bytes after both were freed", (long long)total);
    }
    vkDestroyDevice(reuse_device, NULL);
    vkDestroyInstance(instance, NULL);
}

static int send_fd(int socket, int fd)
{
    char byte = 0;
    struct iovec part = {.iov_base = &byte, .iov_len = 1};
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct msghdr message = {.msg_iov = &part, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof control};
    struct cmsghdr *header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(header), &fd, sizeof fd);
    return sendmsg(socket, &message, 0) == 1 ? 0 : -1;
}

static int receive_fd(int socket)
{
    char byte;
    char control[CMSG_SPACE(sizeof(int))];
    struct iovec part = {.iov_base = &byte, .iov_len = 1};
    struct msghdr message = {.msg_iov = &part, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof control};
    int fd = -1;
    if (recvmsg(socket, &message, 0) == 1 && CMSG_FIRSTHDR(&message) != NULL) {
        memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&message)), sizeof fd);
    }
    return fd;
}

/* An exporter of 200 MiB that hands its fd over, frees its memory and ends: 0 where it did. */
static int export_and_hand_over(int socket)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    const char *extensions[] = {VK_KHR_EXTERNAL_MEMORY_EXTENSION_NAME, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME};
    VkDevice device = make_device(physical, extensions, 2);
    PFN_vkGetMemoryFdKHR get_fd = (PFN_vkGetMemoryFdKHR)vkGetDeviceProcAddr(device, "vkGetMemoryFdKHR");
    VkExportMemoryAllocateInfo export = {.sType = VK_STRUCTURE_TYPE_EXPORT_MEMORY_ALLOCATE_INFO,
                                         .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
    VkDeviceMemory memory;
    if (get_fd == NULL || allocate(device, 200 * MIB, &export, &memory) != VK_SUCCESS) {
        return 3;
    }
    VkMemoryGetFdInfoKHR info = {.sType = VK_STRUCTURE_TYPE_MEMORY_GET_FD_INFO_KHR, .memory = memory,
                                 .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
    int fd = -1;
    if (get_fd(device, &info, &fd) != VK_SUCCESS || fd < 0 || send_fd(socket, fd) != 0) {
        return 5;
    }
    close(fd);
    char byte;
    if (read(socket, &byte, 1) != 1) { /* until the importer holds it */
        return 6;
    }
    vkFreeMemory(device, memory, NULL);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
    return failures == 0 ? 0 : 1;
}

/* Exported memory is charged once, to its object, while any process of the allocation holds it: the exporter ends,
 * the importer's handle keeps it charged; the importer frees it, and nothing is. */
static void export_handoff(void)
{
    VkInstance instance = make_instance();
    VkPhysicalDevice physical = first_gpu(instance);
    if (!has_device_extension(physical, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME, NULL)) {
        printf("%s: skipped: the driver has no VK_KHR_external_memory_fd\n", scenario_name);
        vkDestroyInstance(instance, NULL);
        return;
    }
    int sockets[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets) == 0, "socketpair");
    fflush(NULL);
    pid_t exporter = fork();
    if (exporter == 0) {
        close(sockets[0]);
        _exit(export_and_hand_over(sockets[1]));
    }
    close(sockets[1]);
    const char *extensions[] = {VK_KHR_EXTERNAL_MEMORY_EXTENSION_NAME, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME};
    VkDevice device = make_device(physical, extensions, 2);
    int fd = receive_fd(sockets[0]);
    CHECK(fd >= 0, "no fd from the exporter");
    VkImportMemoryFdInfoKHR import = {.sType = VK_STRUCTURE_TYPE_IMPORT_MEMORY_FD_INFO_KHR,
                                      .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT, .fd = fd};
    VkDeviceMemory imported = VK_NULL_HANDLE;
    VkResult result = fd >= 0 ? allocate(device, 200 * MIB, &import, &imported) : VK_ERROR_INVALID_EXTERNAL_HANDLE;
    CHECK(result == VK_SUCCESS, "importing the exporter's memory: %d", result);
    if (result != VK_SUCCESS && fd >= 0) {
        close(fd);
    }
    CHECK(write(sockets[0], "h", 1) == 1, "telling the exporter");
    int status = 0;
    waitpid(exporter, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the exporter ended with %d", status);
    close(sockets[0]);
    int64_t total = total_after_a_while();
    CHECK(total == (int64_t)(200 * MIB), "total %lld MiB with the exporter gone, the import held",
          (long long)(total / (int64_t)MIB));
    VkDeviceMemory more;
    result = allocate(device, 100 * MIB, NULL, &more);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "100 MiB more beside the held 200 MiB: %d", result);
    if (result == VK_SUCCESS) vkFreeMemory(device, more, NULL);
    if (imported != VK_NULL_HANDLE) vkFreeMemory(device, imported, NULL);
    total = total_becomes(0);
    CHECK(total == 0, "total %lld once the importer freed it", (long long)total);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* The daemon killed mid-run: a free goes on at once; an allocation waits GPUPPETTI_VK_LEDGER_WAIT_MS and is refused.
 * A new daemon is told what the process holds as soon as it is there, before any allocation, and allocations work
 * again. */
static void ledger_away(void)
{
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkDeviceMemory kept, freed, late;
    CHECK(allocate(device, 64 * MIB, NULL, &kept) == VK_SUCCESS, "64 MiB");
    CHECK(allocate(device, 16 * MIB, NULL, &freed) == VK_SUCCESS, "16 MiB");
    pid_t daemon = (pid_t)atoi(getenv("HARNESS_LEDGER_PID") != NULL ? getenv("HARNESS_LEDGER_PID") : "0");
    CHECK(daemon > 0, "no HARNESS_LEDGER_PID");
    if (daemon <= 0) return;
    kill(daemon, SIGKILL);
    usleep(100000);
    int64_t began = clock_ns();
    vkFreeMemory(device, freed, NULL);
    int64_t took = clock_ns() - began;
    CHECK(took < 50000000, "a free waited %lld ms for the daemon", (long long)(took / 1000000));
    began = clock_ns();
    VkResult result = allocate(device, 16 * MIB, NULL, &late);
    int64_t waited = clock_ns() - began;
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "an allocation while the daemon is away: %d", result);
    CHECK(waited >= 300000000 && waited < 5000000000, "it waited %lld ms (GPUPPETTI_VK_LEDGER_WAIT_MS=300)",
          (long long)(waited / 1000000));
    if (result == VK_SUCCESS) vkFreeMemory(device, late, NULL);
    char directory[512];
    snprintf(directory, sizeof directory, "%s", getenv("GPUPPETTI_VK_LEDGER"));
    char *slash = strrchr(directory, '/');
    if (slash != NULL) *slash = '\0';
    pid_t again = ledger_start(directory, getenv("HARNESS_LEDGER_BUDGETS"), NULL);
    CHECK(again > 0, "a new daemon");
    /* The new daemon knows the 64 MiB held from before it, not the spare the old one had. */
    struct ledger_shared *page = observe_at(getenv("GPUPPETTI_VK_LEDGER"));
    int64_t total = total_on(page, (int64_t)(64 * MIB));
    CHECK(total == (int64_t)(64 * MIB), "the new daemon's total %lld MiB before any allocation",
          (long long)(total / (int64_t)MIB));
    result = allocate(device, 16 * MIB, NULL, &late);
    CHECK(result == VK_SUCCESS, "an allocation once a new daemon answers: %d", result);
    total = total_on(page, (int64_t)(80 * MIB));
    CHECK(total == (int64_t)(80 * MIB), "the new daemon's total %lld MiB", (long long)(total / (int64_t)MIB));
    VkDeviceMemory past;
    result = allocate(device, 200 * MIB, NULL, &past);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "200 MiB more past the new daemon's budget: %d", result);
    if (result == VK_SUCCESS) vkFreeMemory(device, past, NULL);
    vkFreeMemory(device, late, NULL);
    vkFreeMemory(device, kept, NULL);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
    ledger_stop(again, SIGTERM);
}

/* Without a ledger, each process is held to the slice's budget alone: another's memory is not in its count. */
static void held_alone(void)
{
    int ready[2];
    CHECK(pipe(ready) == 0, "pipe");
    fflush(NULL);
    pid_t other = fork();
    if (other == 0) {
        close(ready[0]);
        VkInstance instance = make_instance();
        VkDevice device = make_device(first_gpu(instance), NULL, 0);
        VkDeviceMemory memory;
        char byte = allocate(device, 200 * MIB, NULL, &memory) == VK_SUCCESS ? 'y' : 'n';
        if (write(ready[1], &byte, 1) != 1) _exit(1);
        pause();
        _exit(0);
    }
    close(ready[1]);
    char byte = 0;
    CHECK(read(ready[0], &byte, 1) == 1 && byte == 'y', "the other process's 200 MiB was refused");
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkDeviceMemory mine, more;
    VkResult result = allocate(device, 200 * MIB, NULL, &mine);
    CHECK(result == VK_SUCCESS, "200 MiB beside the other's 200 MiB: %d", result);
    result = allocate(device, 100 * MIB, NULL, &more);
    CHECK(result == VK_ERROR_OUT_OF_DEVICE_MEMORY, "100 MiB more past this process's 256 MiB: %d", result);
    kill(other, SIGKILL);
    waitpid(other, NULL, 0);
    close(ready[0]);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* A socket that answers HELLO with what is not a ledger's answer: said once, and the process is held alone. */
static void *answer_garbage(void *listener)
{
    int client = accept(*(int *)listener, NULL, NULL);
    if (client >= 0) {
        char request[sizeof(struct ledger_request)];
        ssize_t got = recv(client, request, sizeof request, MSG_WAITALL);
        struct ledger_answer answer = {.status = LEDGER_OK, .count = 7, .value = 1};
        if (got == (ssize_t)sizeof request) {
            send(client, &answer, sizeof answer, MSG_NOSIGNAL);
        }
        close(client);
    }
    return NULL;
}

static void ledger_garbage(void)
{
    char path[sizeof temporary + 32];
    snprintf(path, sizeof path, "%s/garbage.sock", getenv("HARNESS_TEMPORARY"));
    struct sockaddr_un address;
    int listener = socket_address(path, &address) ? socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
    unlink(path);
    CHECK(listener >= 0 && bind(listener, (struct sockaddr *)&address, sizeof address) == 0 &&
          listen(listener, 4) == 0, "a socket at %s", path);
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, answer_garbage, &listener) == 0, "pthread_create");
    setenv("GPUPPETTI_VK_LEDGER", path, 1);
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkDeviceMemory held[64];
    VkResult refusal;
    VkDeviceSize obtained = fill(device, 16 * MIB, &refusal, held, 64);
    CHECK(refusal == VK_ERROR_OUT_OF_DEVICE_MEMORY && obtained == SLICE_MIB * MIB, "%llu MiB, then %d",
          (unsigned long long)(obtained / MIB), refusal);
    free_held(device, held, 64);
    pthread_join(thread, NULL);
    close(listener);
    unlink(path);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* The compute share is the ledger's, whatever the environment says: with none there, a share of a thousandth from the
 * ledger holds the submits back, and their wait shows on the shared page. */
static void compute_from_the_ledger(void)
{
    VkInstance instance = make_instance();
    VkDevice device = make_device(first_gpu(instance), NULL, 0);
    VkQueue queue;
    vkGetDeviceQueue(device, 0, 0, &queue);
    VkSubmitInfo submit = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO};
    /* Back to back, as throttled_submits: with a share of a thousandth some of them wait, however late the layer's
     * thread sees a batch end on a busy machine (one at a time, each waited for, the next could come before its
     * predecessor was charged). */
    for (int i = 0; i < 50; i++) {
        VkResult result = vkQueueSubmit(queue, 1, &submit, VK_NULL_HANDLE);
        CHECK(result == VK_SUCCESS, "submit %d: %d", i, result);
    }
    CHECK(vkQueueWaitIdle(queue) == VK_SUCCESS, "vkQueueWaitIdle");
    struct ledger_shared *page = observe();
    int64_t waited = page != NULL ? atomic_load(&page->slice[0].waited_ns) : -1;
    CHECK(waited > 0, "the submits waited %lld ns under the ledger's share", (long long)waited);
    vkDestroyDevice(device, NULL);
    vkDestroyInstance(instance, NULL);
}

/* -- running them ---------------------------------------------------------------------------------------------- */

struct scenario {
    const char *name;
    void (*run)(void);
};

static const struct scenario scenarios[] = {
    {"many-instances", many_instances},       {"many-devices", many_devices},
    {"pass-through-budget", pass_through_budget}, {"slice-edge", slice_edge},
    {"exported-memory", exported_memory},     {"hold", hold},
    {"budget-after-kills", budget_after_kills}, {"throttled-submits", throttled_submits},
    {"fake-pass-through", fake_pass_through}, {"fake-own-budget", fake_own_budget},
    {"fake-discrete-slice", fake_discrete_slice}, {"fake-integrated-slice", fake_integrated_slice},
    {"fake-refuses-typos", fake_refuses_typos},
    {"fork-free", fork_free},                 {"fork-own-connection", fork_own_connection},
    {"shared-edge", shared_edge},             {"free-reuse", free_reuse},
    {"export-handoff", export_handoff},       {"ledger-away", ledger_away},
    {"held-alone", held_alone},               {"ledger-garbage", ledger_garbage},
    {"ledger-compute", compute_from_the_ledger},
};

/* The shares the next ledger is served with, where they are not the environment's. */
static const char *daemon_compute;

/* The driver a scenario runs on: lavapipe, or the fake driver with its settings. */
struct driver {
    const char *manifest;     /* the ICD manifest the loader is given */
    const char *settings[8];  /* the fake driver's, NAME=VALUE, up to a NULL */
};

static const char *const fake_settings[] = {"FAKE_ICD_GPUS", "FAKE_ICD_TYPE", "FAKE_ICD_HEAPS", "FAKE_ICD_BUDGET",
                                            "FAKE_ICD_ELSEWHERE", "FAKE_ICD_PCI", "FAKE_ICD_VENDOR",
                                            "FAKE_ICD_DEVICE", "FAKE_ICD_REUSE"};

/* Start one scenario in a process of its own with these settings, on that driver, and the ledger (served by the
 * process daemon, with these budgets) where it has one. */
static pid_t start(const char *self, const char *name, const char *slices, const char *compute, pid_t daemon,
                   const char *budgets, const struct driver *driver)
{
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        unsetenv("GPUPPETTI_VK_SLICES");
        unsetenv("GPUPPETTI_VK_COMPUTE");
        unsetenv("GPUPPETTI_VK_LEDGER");
        unsetenv("GPUPPETTI_VK_LEDGER_WAIT_MS");
        if (slices != NULL) setenv("GPUPPETTI_VK_SLICES", slices, 1);
        if (compute != NULL) setenv("GPUPPETTI_VK_COMPUTE", compute, 1);
        if (daemon > 0) {
            char socket_path[sizeof ledger_dir + 16], pid[32];
            snprintf(socket_path, sizeof socket_path, "%s/ledger.sock", ledger_dir);
            snprintf(pid, sizeof pid, "%d", (int)daemon);
            setenv("GPUPPETTI_VK_LEDGER", socket_path, 1);
            /* Short, so that the scenario where the daemon is away does not wait for long. */
            setenv("GPUPPETTI_VK_LEDGER_WAIT_MS", "300", 1);
            setenv("HARNESS_LEDGER_PID", pid, 1);
            setenv("HARNESS_LEDGER_BUDGETS", budgets, 1);
        }
        /* That driver and no other: VK_DRIVER_FILES for a newer loader, VK_ICD_FILENAMES for an older one. */
        setenv("VK_DRIVER_FILES", driver->manifest, 1);
        setenv("VK_ICD_FILENAMES", driver->manifest, 1);
        unsetenv("VK_ADD_DRIVER_FILES");
        for (size_t i = 0; i < sizeof fake_settings / sizeof *fake_settings; i++) {
            unsetenv(fake_settings[i]);
        }
        for (int i = 0; i < 8 && driver->settings[i] != NULL; i++) {
            char setting[256];
            snprintf(setting, sizeof setting, "%s", driver->settings[i]);
            char *equals = strchr(setting, '=');
            if (equals != NULL) {
                *equals = '\0';
                setenv(setting, equals + 1, 1);
            }
        }
        execl(self, self, name, (char *)NULL);
        _exit(127);
    }
    return child;
}

/* What a report line says of the driver: lavapipe, or the fake driver's settings. */
static void describe(const struct driver *driver, char *out, size_t size)
{
    if (driver->settings[0] == NULL) {
        snprintf(out, size, "lavapipe");
        return;
    }
    size_t used = (size_t)snprintf(out, size, "fake:");
    for (int i = 0; i < 8 && driver->settings[i] != NULL && used < size; i++) {
        const char *setting = driver->settings[i];
        if (strncmp(setting, "FAKE_ICD_", 9) == 0) {
            setting += 9;
        }
        used += (size_t)snprintf(out + used, size - used, " %s", setting);
    }
}

static void report(const char *name, const char *slices, const struct driver *driver, bool ok)
{
    char described[512];
    describe(driver, described, sizeof described);
    printf("%-22s %-56s %-6s %s\n", name, slices != NULL ? slices : "(no slice)", ok ? "ok" : "FAILED", described);
}

/* Run one scenario in a process of its own with these settings, with a ledger of these budgets (NULL: none);
 * whether it ended as expected. */
static bool run(const char *self, const char *name, const char *slices, const char *compute, const char *budgets,
                int expect_signal, const struct driver *driver)
{
    const char *shares = daemon_compute != NULL ? daemon_compute : compute;
    pid_t daemon = budgets != NULL ? ledger_start(ledger_dir, budgets, shares) : 0;
    bool ok = daemon >= 0;
    if (ok) {
        pid_t child = start(self, name, slices, compute, daemon, budgets, driver);
        int status = 0;
        waitpid(child, &status, 0);
        ok = expect_signal != 0 ? WIFSIGNALED(status) && WTERMSIG(status) == expect_signal
                                : WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && WIFSIGNALED(status)) {
            printf("    killed by signal %d\n", WTERMSIG(status));
        }
    }
    ledger_stop(daemon, SIGTERM);
    report(name, slices, driver, ok);
    return ok;
}

/* Two processes hold 100 MiB each of one slice and are SIGKILLed: the ledger gives it back at once, and a process
 * after them sees the whole budget. */
static bool killed_holders(const char *self, const char *slice, const char *budgets, const struct driver *driver)
{
    pid_t daemon = ledger_start(ledger_dir, budgets, NULL);
    if (daemon < 0) {
        report("hold (two, SIGKILLed)", slice, driver, false);
        return false;
    }
    char socket_path[sizeof ledger_dir + 16];
    snprintf(socket_path, sizeof socket_path, "%s/ledger.sock", ledger_dir);
    struct ledger_shared *page = observe_at(socket_path);
    pid_t holders[2];
    for (int i = 0; i < 2; i++) {
        holders[i] = start(self, "hold", slice, NULL, daemon, budgets, driver);
    }
    int64_t total = 0;
    for (int tries = 0; page != NULL && tries < 600 && total < (int64_t)(200 * MIB); tries++) {
        total = atomic_load(&page->slice[0].total);
        usleep(50000);
    }
    bool ok = total == (int64_t)(200 * MIB);
    for (int i = 0; i < 2; i++) {
        kill(holders[i], SIGKILL);
        waitpid(holders[i], NULL, 0);
    }
    /* At once: as soon as the daemon sees their connections close (within two seconds on a busy machine). */
    for (int tries = 0; page != NULL && tries < 200 && total != 0; tries++) {
        usleep(10000);
        total = atomic_load(&page->slice[0].total);
    }
    ok &= total == 0;
    report("hold (two, SIGKILLed)", slice, driver, ok);
    pid_t after = start(self, "budget-after-kills", slice, NULL, daemon, budgets, driver);
    int status = 0;
    waitpid(after, &status, 0);
    bool after_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    report("budget-after-kills", slice, driver, after_ok);
    ledger_stop(daemon, SIGTERM);
    if (page != NULL) {
        munmap(page, LEDGER_SHARED_SIZE);
    }
    return ok && after_ok;
}

static bool on_lavapipe(const char *self, const char *manifest)
{
    const struct driver lavapipe = {.manifest = manifest};
    char slice[64], budgets[32];
    snprintf(slice, sizeof slice, "any=%llu", (unsigned long long)(SLICE_MIB * MIB));
    snprintf(budgets, sizeof budgets, "%llu", (unsigned long long)(SLICE_MIB * MIB));
    bool ok = true;
    ok &= run(self, "many-instances", NULL, NULL, NULL, 0, &lavapipe);
    ok &= run(self, "many-instances", slice, NULL, NULL, 0, &lavapipe);
    ok &= run(self, "many-devices", NULL, NULL, NULL, 0, &lavapipe);
    ok &= run(self, "many-devices", slice, NULL, budgets, 0, &lavapipe);
    ok &= run(self, "pass-through-budget", NULL, NULL, NULL, 0, &lavapipe);
    ok &= run(self, "pass-through-budget", "not a slice", NULL, NULL, 0, &lavapipe);
    ok &= run(self, "slice-edge", slice, NULL, budgets, 0, &lavapipe);
    ok &= run(self, "slice-edge", slice, NULL, NULL, 0, &lavapipe);
    ok &= run(self, "exported-memory", slice, NULL, budgets, 0, &lavapipe);
    ok &= killed_holders(self, slice, budgets, &lavapipe);
    ok &= run(self, "throttled-submits", slice, "250", budgets, 0, &lavapipe);
    ok &= run(self, "export-handoff", slice, NULL, budgets, 0, &lavapipe);
    daemon_compute = "1";
    ok &= run(self, "ledger-compute", slice, NULL, budgets, 0, &lavapipe);
    daemon_compute = NULL;
    return ok;
}

static bool on_the_fake_driver(const char *self, const char *manifest)
{
#define PCI2 "FAKE_ICD_PCI=0000:03:00.0,0000:04:00.0"
#define PCI3 "FAKE_ICD_PCI=0000:03:00.0,0000:04:00.0,0000:05:00.0"
#define IDS "FAKE_ICD_VENDOR=0x1234", "FAKE_ICD_DEVICE=0x5678"
    const struct driver two = {manifest, {"FAKE_ICD_GPUS=2", "FAKE_ICD_HEAPS=device:8G,host:16G", PCI2, IDS}};
    const struct driver two_budget = {manifest, {"FAKE_ICD_GPUS=2", "FAKE_ICD_HEAPS=device:8G,host:16G", PCI2, IDS,
                                                 "FAKE_ICD_BUDGET=1", "FAKE_ICD_ELSEWHERE=1G"}};
    const struct driver roomy = {manifest, {"FAKE_ICD_HEAPS=device:1G,host:4G", "FAKE_ICD_BUDGET=1"}};
    const struct driver crowded = {manifest, {"FAKE_ICD_HEAPS=device:1G,host:4G", "FAKE_ICD_BUDGET=1",
                                              "FAKE_ICD_ELSEWHERE=896M"}};
    const struct driver discrete = {manifest, {"FAKE_ICD_HEAPS=device:8G,bar:256M,host:16G"}};
    const struct driver integrated = {manifest, {"FAKE_ICD_TYPE=integrated", "FAKE_ICD_HEAPS=device:4G,host:8G"}};
    const struct driver three = {manifest, {"FAKE_ICD_GPUS=3", "FAKE_ICD_HEAPS=device:8G,host:16G", "FAKE_ICD_BUDGET=1",
                                            "FAKE_ICD_ELSEWHERE=2G", PCI3}};
    const struct driver three_no_pci = {manifest, {"FAKE_ICD_GPUS=3", "FAKE_ICD_HEAPS=device:8G,host:16G",
                                                   "FAKE_ICD_BUDGET=1", "FAKE_ICD_ELSEWHERE=2G"}};
#undef PCI2
#undef PCI3
#undef IDS
    char slice[64], budgets[32];
    snprintf(slice, sizeof slice, "any=%llu", (unsigned long long)(SLICE_MIB * MIB));
    snprintf(budgets, sizeof budgets, "%llu", (unsigned long long)(SLICE_MIB * MIB));
    const char *whole = "pci:0000:03:00.0=0,pci:0000:04:00.0=0";
    bool ok = true;
    /* No slice applies: none, one that does not parse, whole GPUs (any=0, or each named with 0). */
    const char *no_slice[] = {NULL, "not a slice", "any=0", whole};
    for (size_t i = 0; i < sizeof no_slice / sizeof *no_slice; i++) {
        ok &= run(self, "fake-pass-through", no_slice[i], NULL, NULL, 0, &two);
        ok &= run(self, "fake-pass-through", no_slice[i], NULL, NULL, 0, &two_budget);
    }
    /* The driver's budget above the slice's, and below it. */
    ok &= run(self, "fake-own-budget", slice, NULL, NULL, 0, &roomy);
    ok &= run(self, "fake-own-budget", slice, NULL, budgets, 0, &roomy);
    ok &= run(self, "fake-own-budget", slice, NULL, NULL, 0, &crowded);
    ok &= run(self, "fake-discrete-slice", "any=1073741824", NULL, NULL, 0, &discrete);
    ok &= run(self, "fake-discrete-slice", "any=1073741824", NULL, "1073741824", 0, &discrete);
    ok &= run(self, "fake-integrated-slice", "any=805306368", NULL, NULL, 0, &integrated);
    for (size_t i = 0; i < sizeof gpus_cases / sizeof *gpus_cases; i++) {
        ok &= run(self, gpus_cases[i].name, gpus_cases[i].slices, NULL, NULL, 0,
                  gpus_cases[i].pci ? &three : &three_no_pci);
    }
    /* A configuration the fake driver cannot parse fails instance creation: its scenarios cannot pass by
     * testing something else. */
    const struct driver typo = {manifest, {"FAKE_ICD_HEAPS=device:8Q"}};
    ok &= run(self, "fake-refuses-typos", NULL, NULL, NULL, 0, &typo);
    ok &= run(self, "fork-free", slice, NULL, budgets, 0, &roomy);
    const struct driver reusing = {manifest, {"FAKE_ICD_HEAPS=device:1G,host:4G", "FAKE_ICD_REUSE=1"}};
    ok &= run(self, "free-reuse", slice, NULL, budgets, 0, &reusing);
    ok &= run(self, "fork-own-connection", slice, NULL, budgets, 0, &roomy);
    ok &= run(self, "shared-edge", slice, NULL, budgets, 0, &roomy);
    ok &= run(self, "ledger-away", slice, NULL, budgets, 0, &roomy);
    ok &= run(self, "held-alone", slice, NULL, NULL, 0, &roomy);
    ok &= run(self, "ledger-garbage", slice, NULL, NULL, 0, &roomy);
    return ok;
}

int main(int argc, char **argv)
{
    if (argc == 2) {
        for (size_t i = 0; i < sizeof scenarios / sizeof *scenarios; i++) {
            if (strcmp(argv[1], scenarios[i].name) == 0) {
                scenario_name = scenarios[i].name;
                scenarios[i].run();
                return failures == 0 ? 0 : 1;
            }
        }
        for (size_t i = 0; i < sizeof gpus_cases / sizeof *gpus_cases; i++) {
            if (strcmp(argv[1], gpus_cases[i].name) == 0) {
                scenario_name = gpus_cases[i].name;
                gpus_case = &gpus_cases[i];
                several_gpus();
                return failures == 0 ? 0 : 1;
            }
        }
        fprintf(stderr, "harness: no scenario %s\n", argv[1]);
        return 2;
    }
    const char *lavapipe = getenv("HARNESS_LAVAPIPE");
    const char *fake = getenv("HARNESS_FAKE_ICD");
    if (fake == NULL || *fake == '\0' || getenv("HARNESS_FAKE_ICD_LIBRARY") == NULL) {
        fprintf(stderr, "harness: HARNESS_FAKE_ICD and HARNESS_FAKE_ICD_LIBRARY are not set (make check sets them)\n");
        return 1;
    }
    if (mkdtemp(temporary) == NULL) {
        perror("harness: mkdtemp");
        return 1;
    }
    snprintf(ledger_dir, sizeof ledger_dir, "%s/ledger", temporary);
    setenv("HARNESS_TEMPORARY", temporary, 1);
    bool ok = true;
    if (lavapipe != NULL && *lavapipe != '\0') {
        ok &= on_lavapipe(argv[0], lavapipe);
    }
    ok &= on_the_fake_driver(argv[0], fake);
    char path[sizeof ledger_dir + 16];
    snprintf(path, sizeof path, "%s/ledger.sock", ledger_dir);
    unlink(path);
    rmdir(ledger_dir);
    rmdir(temporary);
    printf("%s\n", ok ? "every scenario passed" : "some scenarios FAILED");
    return ok ? 0 : 1;
}
